import { InfinijupRequestError } from '../src/errors';
import { INotifier, NotificationKind } from '../src/progress';
import { RestActions } from '../src/restActions';
import {
  applyEvent,
  fromStatus,
  IRestAPI,
  IRestEvent,
  IRestInfo,
  IRestStatus,
  parseRestEvent,
  restLabel,
  RestStates,
  RUNNING
} from '../src/restState';
import { EVENT_SCHEMA_ID } from '../src/types';

const K = 'kernel-1';

function ev(
  op: string,
  phase: string,
  extra: Partial<IRestEvent> = {}
): IRestEvent {
  return {
    op,
    kernel_id: K,
    phase,
    percent: phase === 'done' || phase === 'error' ? 100 : 0,
    message: '',
    ...extra
  };
}

function info(state: IRestInfo['state'], extra: Partial<IRestInfo> = {}) {
  return { ...RUNNING, state, ...extra };
}

/** A server whose replies the test resolves by hand. */
class FakeAPI implements IRestAPI {
  statusCalls: string[] = [];
  hibernateCalls: string[] = [];
  wakeCalls: string[] = [];
  pendingStatus: ((s: IRestStatus) => void)[] = [];
  status = jest.fn((kernelId: string) => {
    this.statusCalls.push(kernelId);
    return new Promise<IRestStatus>(resolve =>
      this.pendingStatus.push(resolve)
    );
  });
  hibernateReply: () => Promise<any> = async () => ({
    state: 'hibernated',
    commit: 'c'.repeat(64)
  });
  wakeReply: () => Promise<any> = async () => ({ state: 'running' });
  hibernate = jest.fn((kernelId: string) => {
    this.hibernateCalls.push(kernelId);
    return this.hibernateReply();
  });
  wake = jest.fn((kernelId: string) => {
    this.wakeCalls.push(kernelId);
    return this.wakeReply();
  });
}

class FakeNotifier implements INotifier {
  notes: { message: string; type: NotificationKind; options?: any }[] = [];
  emit(message: string, type: NotificationKind, options?: any): string {
    this.notes.push({ message, type, options });
    return `n${this.notes.length}`;
  }
  update(): boolean {
    return true;
  }
  dismiss(): void {
    /* nothing */
  }
}

describe('parseRestEvent', () => {
  it('reads hibernate, release and wake events with their kernel_state', () => {
    const e = parseRestEvent({
      schema_id: EVENT_SCHEMA_ID,
      op: 'wake',
      op_id: 'o',
      kernel_id: K,
      phase: 'queued',
      percent: 0,
      kernel_state: 'waking'
    });
    expect(e).toMatchObject({
      op: 'wake',
      phase: 'queued',
      kernel_state: 'waking'
    });
  });

  it('drops other schemas, missing fields and unknown states', () => {
    expect(parseRestEvent({ schema_id: 'other', op: 'wake' })).toBeNull();
    expect(
      parseRestEvent({ schema_id: EVENT_SCHEMA_ID, op: 'wake', phase: 'done' })
    ).toBeNull();
    const e = parseRestEvent({
      schema_id: EVENT_SCHEMA_ID,
      op: 'wake',
      kernel_id: K,
      phase: 'done',
      percent: 'x',
      kernel_state: 'asleep'
    });
    expect(e?.kernel_state).toBeUndefined();
    expect(e?.percent).toBe(0);
  });
});

describe('applyEvent', () => {
  it('follows hibernate, wake (with restore progress) and back to running', () => {
    let s: IRestInfo = RUNNING;
    s = applyEvent(
      s,
      ev('hibernate', 'done', { kernel_state: 'hibernated', commit: 'ab12' })
    );
    expect(s).toMatchObject({ state: 'hibernated', commit: 'ab12' });
    s = applyEvent(s, ev('wake', 'queued', { kernel_state: 'waking' }));
    expect(s).toMatchObject({ state: 'waking', percent: 0 });
    s = applyEvent(s, ev('restore', 'restore', { percent: 40 }));
    expect(s.percent).toBe(40);
    // progress only moves forward
    s = applyEvent(s, ev('restore', 'kill', { percent: 20 }));
    expect(s.percent).toBe(40);
    // the restore's done is not the wake's: still waking
    s = applyEvent(s, ev('restore', 'done'));
    expect(s.state).toBe('waking');
    s = applyEvent(s, ev('wake', 'done', { kernel_state: 'running' }));
    expect(s).toEqual(RUNNING);
  });

  it('a failed wake leaves the kernel hibernated, with the reason', () => {
    const s = applyEvent(
      info('waking', { commit: 'ab12', percent: 30 }),
      ev('wake', 'error', {
        kernel_state: 'hibernated',
        message: 'no space left',
        reason: 'restore_failed'
      })
    );
    expect(s).toEqual({
      state: 'hibernated',
      percent: null,
      commit: 'ab12',
      error: { message: 'no space left', reason: 'restore_failed' }
    });
    expect(restLabel(s)?.title).toContain('no space left (restore_failed)');
  });

  it('release and its wake', () => {
    let s = applyEvent(
      RUNNING,
      ev('release', 'done', { kernel_state: 'released' })
    );
    expect(s.state).toBe('released');
    s = applyEvent(s, ev('wake', 'queued', { kernel_state: 'waking' }));
    expect(s.state).toBe('waking');
    s = applyEvent(s, ev('wake', 'done', { kernel_state: 'running' }));
    expect(s.state).toBe('running');
  });

  it('snapshot progress while hibernating; not otherwise', () => {
    const s = applyEvent(
      info('hibernating', { percent: 0 }),
      ev('snapshot', 'dump', { percent: 55 })
    );
    expect(s.percent).toBe(55);
    expect(applyEvent(RUNNING, ev('snapshot', 'dump', { percent: 55 }))).toBe(
      RUNNING
    );
    expect(
      applyEvent(
        info('waking', { percent: 10 }),
        ev('snapshot', 'dump', { percent: 55 })
      ).percent
    ).toBe(10);
  });

  it('a restore the user asked for ends a hibernation', () => {
    expect(applyEvent(info('hibernated'), ev('restore', 'done')).state).toBe(
      'running'
    );
    expect(applyEvent(info('hibernated'), ev('restore', 'dump')).state).toBe(
      'hibernated'
    );
  });

  it('a failed hibernation says the kernel runs', () => {
    const s = applyEvent(
      info('hibernating'),
      ev('hibernate', 'error', {
        kernel_state: 'running',
        message: 'busy',
        reason: 'kernel_busy'
      })
    );
    expect(s.state).toBe('running');
    expect(restLabel(s)).toBeNull();
  });
});

describe('fromStatus and restLabel', () => {
  it('reads /status (older servers without state: running)', () => {
    expect(fromStatus({})).toEqual(RUNNING);
    expect(fromStatus(null)).toEqual(RUNNING);
    expect(fromStatus({ state: 'bogus' })).toEqual(RUNNING);
    expect(
      fromStatus({ state: 'hibernated', head: { commit: 'f'.repeat(64) } })
    ).toMatchObject({ state: 'hibernated', commit: 'f'.repeat(64) });
    expect(
      fromStatus({
        state: 'waking',
        operation: { op: 'restore', phase: 'restore', percent: 70 }
      })
    ).toMatchObject({ state: 'waking', percent: 70 });
    expect(fromStatus({ state: 'released' }).percent).toBeNull();
  });

  it('labels: nothing while running; the three rest states', () => {
    expect(restLabel(RUNNING)).toBeNull();
    expect(restLabel(null)).toBeNull();
    expect(restLabel(info('released'))).toMatchObject({
      text: 'GPU released',
      wakes: true
    });
    const h = restLabel(info('hibernated', { commit: 'abcdef0123456789' }));
    expect(h).toMatchObject({ text: 'Hibernated', wakes: true });
    expect(h?.title).toContain('abcdef01');
    expect(restLabel(info('waking', { percent: 0 }))?.text).toBe('Waking…');
    expect(restLabel(info('waking', { percent: 42.4 }))).toMatchObject({
      text: 'Waking… 42%',
      wakes: false
    });
    expect(restLabel(info('hibernating', { percent: 0 }))?.text).toBe(
      'Hibernating…'
    );
  });
});

describe('RestStates', () => {
  it('asks /status once per kernel and tells a hibernated one', async () => {
    const api = new FakeAPI();
    const states = new RestStates(api);
    const seen: string[] = [];
    states.changed.connect((_, id) => seen.push(states.get(id).state));
    const first = states.refresh(K);
    const second = states.refresh(K);
    expect(api.statusCalls).toEqual([K]);
    api.pendingStatus[0]({ state: 'hibernated' });
    await first;
    await second;
    expect(states.get(K).state).toBe('hibernated');
    expect(seen).toEqual(['hibernated']);
    await states.refresh(K);
    expect(api.statusCalls).toEqual([K]);
  });

  it('drops a /status reply older than an event', async () => {
    const api = new FakeAPI();
    const states = new RestStates(api);
    const asked = states.refresh(K);
    states.handleEmission({
      schema_id: EVENT_SCHEMA_ID,
      op: 'wake',
      op_id: 'o',
      kernel_id: K,
      phase: 'queued',
      kernel_state: 'waking'
    });
    api.pendingStatus[0]({ state: 'hibernated' });
    await asked;
    expect(states.get(K).state).toBe('waking');
  });

  it('a kernel whose status fails is shown running', async () => {
    const api = new FakeAPI();
    api.status.mockImplementationOnce(async () => {
      throw new InfinijupRequestError('nope', 'extension_missing', 404);
    });
    const states = new RestStates(api);
    const debug = jest.spyOn(console, 'debug').mockImplementation(() => {});
    expect((await states.refresh(K)).state).toBe('running');
    debug.mockRestore();
  });

  it('hibernate: hibernating, then hibernated with the commit', async () => {
    const api = new FakeAPI();
    let resolve!: (v: any) => void;
    api.hibernateReply = () => new Promise(r => (resolve = r));
    const states = new RestStates(api);
    const done = states.hibernate(K);
    expect(states.get(K).state).toBe('hibernating');
    resolve({ state: 'hibernated', commit: 'abc' });
    await done;
    expect(states.get(K)).toMatchObject({ state: 'hibernated', commit: 'abc' });
  });

  it('hibernate: the reply does not undo a wake the events told meanwhile', async () => {
    const api = new FakeAPI();
    let resolve!: (v: any) => void;
    api.hibernateReply = () => new Promise(r => (resolve = r));
    const states = new RestStates(api);
    const done = states.hibernate(K);
    states.handleEvent(ev('hibernate', 'done', { kernel_state: 'hibernated' }));
    states.handleEvent(ev('wake', 'queued', { kernel_state: 'waking' }));
    resolve({ state: 'hibernated', commit: 'abc' });
    await done;
    expect(states.get(K).state).toBe('waking');
  });

  it('hibernate refused: back to running, the error rethrown, /status asked', async () => {
    const api = new FakeAPI();
    api.hibernateReply = async () => {
      throw new InfinijupRequestError('a cell is running', 'kernel_busy', 409);
    };
    const states = new RestStates(api);
    await expect(states.hibernate(K)).rejects.toThrow('a cell is running');
    expect(states.get(K).state).toBe('running');
    expect(api.statusCalls).toEqual([K]);
  });

  it('wake: waking, then running; a running kernel is not woken', async () => {
    const api = new FakeAPI();
    const states = new RestStates(api);
    await states.wake(K);
    expect(api.wakeCalls).toEqual([]);
    states.handleEvent(ev('hibernate', 'done', { kernel_state: 'hibernated' }));
    let resolve!: (v: any) => void;
    api.wakeReply = () => new Promise(r => (resolve = r));
    const done = states.wake(K);
    expect(states.get(K).state).toBe('waking');
    resolve({ kernel_id: K, state: 'running' });
    await done;
    expect(states.get(K).state).toBe('running');
    expect(api.wakeCalls).toEqual([K]);
  });

  it('wake failed: still hibernated, with the reason', async () => {
    const api = new FakeAPI();
    api.wakeReply = async () => {
      throw new InfinijupRequestError('restore failed', 'criu_failed', 500);
    };
    const states = new RestStates(api);
    states.handleEvent(ev('hibernate', 'done', { kernel_state: 'hibernated' }));
    await expect(states.wake(K)).rejects.toThrow('restore failed');
    expect(states.get(K)).toMatchObject({
      state: 'hibernated',
      error: { message: 'restore failed', reason: 'criu_failed' }
    });
  });

  it('forget: back to running, asked again next time', async () => {
    const api = new FakeAPI();
    const states = new RestStates(api);
    states.handleEvent(ev('hibernate', 'done', { kernel_state: 'hibernated' }));
    states.forget(K);
    expect(states.get(K).state).toBe('running');
    void states.refresh(K);
    expect(api.statusCalls).toEqual([K]);
  });
});

describe('RestActions', () => {
  const target = (managed = true, kernel = true) => ({
    name: 'nb.ipynb',
    kernel: kernel ? { id: K, name: 'infinijup' } : null,
    managed
  });

  it('hibernates a managed kernel; says why for others', async () => {
    const api = new FakeAPI();
    const notifier = new FakeNotifier();
    const actions = new RestActions(new RestStates(api), notifier);
    expect(actions.canHibernate(target())).toBe(true);
    expect(actions.canHibernate(target(false))).toBe(false);
    expect(await actions.hibernate(target(false))).toBe(false);
    expect(await actions.hibernate(target(true, false))).toBe(false);
    expect(await actions.hibernate(null)).toBe(false);
    expect(notifier.notes.map(n => n.message)).toEqual([
      expect.stringContaining('not managed by Infinijup'),
      expect.stringContaining('has no kernel running'),
      expect.stringContaining('open a notebook')
    ]);
    expect(api.hibernateCalls).toEqual([]);
    expect(await actions.hibernate(target())).toBe(true);
    expect(api.hibernateCalls).toEqual([K]);
    expect(actions.canHibernate(target())).toBe(false);
    // hibernated already: nothing sent again
    expect(await actions.hibernate(target())).toBe(true);
    expect(api.hibernateCalls).toEqual([K]);
  });

  it('409 busy: an error notification with the server message and reason', async () => {
    const api = new FakeAPI();
    api.hibernateReply = async () => {
      throw new InfinijupRequestError(
        'the kernel stayed busy for 10 s',
        'kernel_busy',
        409
      );
    };
    const notifier = new FakeNotifier();
    const actions = new RestActions(new RestStates(api), notifier);
    expect(await actions.hibernate(target())).toBe(false);
    expect(notifier.notes).toHaveLength(1);
    expect(notifier.notes[0].type).toBe('error');
    expect(notifier.notes[0].message).toBe(
      'Hibernate of nb.ipynb failed: the kernel is running a cell: interrupt it or retry when it ends (kernel_busy)'
    );
    expect(notifier.notes[0].options.details).toEqual({
      title: 'Hibernate of nb.ipynb failed',
      message: 'the kernel stayed busy for 10 s',
      reason: 'kernel_busy'
    });
  });

  it('wake: true when awake; a failure is notified', async () => {
    const api = new FakeAPI();
    const states = new RestStates(api);
    const notifier = new FakeNotifier();
    const actions = new RestActions(states, notifier);
    states.handleEvent(ev('hibernate', 'done', { kernel_state: 'hibernated' }));
    expect(await actions.wake('nb.ipynb', K)).toBe(true);
    states.handleEvent(ev('hibernate', 'done', { kernel_state: 'hibernated' }));
    api.wakeReply = async () => {
      throw new InfinijupRequestError('no snapshot', 'not_found', 404);
    };
    expect(await actions.wake('nb.ipynb', K)).toBe(false);
    expect(notifier.notes.map(n => [n.type, n.message])).toEqual([
      ['error', 'Wake of nb.ipynb failed: no snapshot (not_found)']
    ]);
  });
});
