import { InfinijupRequestError } from '../src/errors';
import {
  failureText,
  INotifier,
  NotificationKind,
  progressBar,
  ProgressTracker,
  samePathOrCopy
} from '../src/progress';
import {
  EVENT_SCHEMA_ID,
  IOperationEvent,
  parseOperationEvent
} from '../src/types';

interface INote {
  id: string;
  message: string;
  type: NotificationKind;
  autoClose?: number | false;
  progress?: number;
  cancel?: () => void;
}

class FakeNotifier implements INotifier {
  notes: INote[] = [];

  emit(
    message: string,
    type: NotificationKind,
    options: { autoClose?: number | false; progress?: number } = {}
  ): string {
    const id = `n${this.notes.length}`;
    this.notes.push({ id, message, type, ...options });
    return id;
  }

  update(args: INote): boolean {
    const note = this.notes.find(n => n.id === args.id);
    if (!note) {
      return false;
    }
    Object.assign(note, { progress: undefined, cancel: undefined }, args);
    return true;
  }

  dismiss(): void {
    // not used
  }
}

function event(over: Partial<IOperationEvent> = {}): IOperationEvent {
  return {
    op: 'snapshot',
    op_id: 'op1',
    kernel_id: 'k1',
    path: 'nb.ipynb',
    phase: 'dump',
    percent: 40,
    message: '',
    ...over
  };
}

describe('ProgressTracker', () => {
  let notifier: FakeNotifier;
  let tracker: ProgressTracker;

  beforeEach(() => {
    notifier = new FakeNotifier();
    tracker = new ProgressTracker({
      notifier,
      isRelevant: ev => ev.kernel_id === 'k1',
      settleMs: 0
    });
  });

  it('offers Cancel only while the operation waits for a busy kernel', () => {
    const cancelled: string[] = [];
    tracker = new ProgressTracker({
      notifier,
      settleMs: 0,
      onCancel: kernelId => cancelled.push(kernelId)
    });
    tracker.begin('snapshot', 'k1', 'Snapshot of nb.ipynb');
    tracker.handleEvent(event({ phase: 'quiesce', percent: 10 }));
    expect(notifier.notes[0].cancel).toBeDefined();
    notifier.notes[0].cancel!();
    expect(cancelled).toEqual(['k1']);
    tracker.handleEvent(event({ phase: 'dump', percent: 30 }));
    expect(notifier.notes[0].cancel).toBeUndefined();
  });

  it('follows a resume by notebook path (its kernel is new)', () => {
    tracker = new ProgressTracker({ notifier, settleMs: 0 });
    const handle = tracker.begin(
      'resume',
      '',
      'Resume of nb.ipynb',
      'nb.ipynb'
    );
    const copy = tracker.begin(
      'resume',
      '',
      'New notebook from a.ipynb',
      'd/a.ipynb'
    );
    // Another notebook's resume is not this one's.
    const other = {
      op: 'resume' as const,
      op_id: 'r0',
      kernel_id: 'kx',
      path: 'other.ipynb'
    };
    tracker.handleEvent(event(other));
    tracker.handleEvent(
      event({
        op: 'resume',
        op_id: 'r1',
        kernel_id: 'k9',
        phase: 'restore',
        percent: 60
      })
    );
    // A resume into a new notebook may report the copy's path, and its
    // phases as a restore into the kernel the server started.
    tracker.handleEvent(
      event({
        op: 'restore',
        op_id: 'r2',
        kernel_id: 'k8',
        path: 'd/a-c0ffee00.ipynb'
      })
    );
    expect(handle.opId).toBe('r1');
    expect(handle.percent).toBe(60);
    expect(copy.opId).toBe('r2');
    handle.succeed(
      'Resumed c0ffee00 in a new kernel in 1.0 s · next snapshot on main'
    );
    const own = notifier.notes.find(n => n.id === handle.notificationId)!;
    expect(own.type).toBe('success');
    // The other notebook's resume got a notification of its own.
    tracker.handleEvent(
      event({ ...other, phase: 'done', commit: 'c0ffee0011', thread: 'main' })
    );
    expect(notifier.notes.map(n => n.message)).toContain(
      'Resumed c0ffee00 on main (other.ipynb)'
    );
  });

  it('tells a notebook from its copies', () => {
    expect(samePathOrCopy('d/a.ipynb', 'd/a.ipynb')).toBe(true);
    expect(samePathOrCopy('d/a.ipynb', 'd/a-1a2b3c4d.ipynb')).toBe(true);
    expect(samePathOrCopy('a.ipynb', 'a-1a2b3c4d.ipynb')).toBe(true);
    expect(samePathOrCopy('d/a.ipynb', 'd/ab.ipynb')).toBe(false);
    expect(samePathOrCopy('d/a.ipynb', 'd/a-x/y.ipynb')).toBe(false);
    expect(samePathOrCopy('d/a.ipynb', 'e/a-1.ipynb')).toBe(false);
    expect(samePathOrCopy('', 'a.ipynb')).toBe(false);
  });
  it('shows the phases of an operation started here, then its result', () => {
    const handle = tracker.begin('snapshot', 'k1', 'Snapshot of nb.ipynb');
    expect(notifier.notes).toHaveLength(1);
    expect(notifier.notes[0]).toMatchObject({
      type: 'in-progress',
      progress: 0,
      autoClose: false
    });
    tracker.handleEvent(event({ phase: 'quiesce', percent: 5 }));
    expect(handle.opId).toBe('op1');
    expect(notifier.notes[0].message).toBe(
      'Snapshot of nb.ipynb: Waiting for the kernel to be idle █░░░░░░░░░ 5%'
    );
    tracker.handleEvent(event({ phase: 'gpu', percent: 30, message: '2 GiB' }));
    expect(notifier.notes[0].message).toBe(
      'Snapshot of nb.ipynb: Saving GPU state ███░░░░░░░ 30% · 2 GiB'
    );
    expect(notifier.notes[0].progress).toBeCloseTo(0.3);
    // a late event from an earlier phase never moves the bar back
    tracker.handleEvent(event({ phase: 'quiesce', percent: 10 }));
    expect(notifier.notes[0].progress).toBeCloseTo(0.3);
    tracker.handleEvent(event({ phase: 'done', percent: 100, commit: 'abc' }));
    expect(notifier.notes[0].type).toBe('in-progress');
    handle.succeed('Snapshot abcdef01 saved');
    expect(notifier.notes).toHaveLength(1);
    expect(notifier.notes[0]).toMatchObject({
      type: 'success',
      message: 'Snapshot abcdef01 saved',
      autoClose: 5000
    });
    expect(tracker.active).toHaveLength(0);
    // events after the end are ignored (no new notification)
    tracker.handleEvent(event({ phase: 'done' }));
    expect(notifier.notes).toHaveLength(1);
  });

  it("shows the server's reason on failure", () => {
    const handle = tracker.begin('restore', 'k1', 'Restore of nb.ipynb');
    tracker.handleEvent(
      event({
        op: 'restore',
        phase: 'error',
        message: 'CRIU failed',
        reason: 'criu_failed'
      })
    );
    expect(notifier.notes[0].message).toBe(
      'Restore of nb.ipynb failed: CRIU failed (criu_failed)'
    );
    handle.fail(
      new InfinijupRequestError("No commit 'deadbeef'", 'not_found', 404)
    );
    expect(notifier.notes[0]).toMatchObject({
      type: 'error',
      message: "Restore of nb.ipynb failed: No commit 'deadbeef' (not_found)",
      autoClose: false
    });
  });

  it('notifies operations started elsewhere on relevant kernels', () => {
    tracker.handleEvent(event({ op_id: 'magic', phase: 'queued', percent: 0 }));
    expect(notifier.notes).toHaveLength(1);
    expect(notifier.notes[0].message).toMatch(/^Snapshot of nb.ipynb: Queued/);
    tracker.handleEvent(
      event({
        op_id: 'magic',
        phase: 'done',
        percent: 100,
        commit: '0123456789abcdef',
        thread: 'main'
      })
    );
    expect(notifier.notes[0]).toMatchObject({
      type: 'success',
      message: 'Snapshot 01234567 saved on main (nb.ipynb)'
    });
    // an unrelated kernel gets nothing
    tracker.handleEvent(event({ op_id: 'other', kernel_id: 'k2' }));
    expect(notifier.notes).toHaveLength(1);
  });

  it('fails external operations from their error event', () => {
    tracker.handleEvent(event({ op_id: 'm', phase: 'dump' }));
    tracker.handleEvent(
      event({
        op_id: 'm',
        phase: 'error',
        message: 'disk full',
        reason: 'store_failed'
      })
    );
    expect(notifier.notes[0]).toMatchObject({
      type: 'error',
      message: 'Snapshot of nb.ipynb failed: disk full (store_failed)'
    });
  });

  it('keeps two operations apart', () => {
    const a = tracker.begin('snapshot', 'k1', 'A');
    const b = tracker.begin('restore', 'k1', 'B');
    tracker.handleEvent(
      event({ op: 'restore', op_id: 'r', phase: 'kill', percent: 50 })
    );
    tracker.handleEvent(
      event({ op: 'snapshot', op_id: 's', phase: 'dump', percent: 20 })
    );
    expect(a.opId).toBe('s');
    expect(b.opId).toBe('r');
    expect(notifier.notes[0].message).toMatch(/^A: Dumping/);
    expect(notifier.notes[1].message).toMatch(/^B: Stopping/);
  });

  it('defers updates of a fresh notification and applies the final state again', () => {
    jest.useFakeTimers();
    try {
      const slow = new ProgressTracker({ notifier, settleMs: 250 });
      const update = jest.spyOn(notifier, 'update');
      const handle = slow.begin('restore', 'k1', 'R');
      slow.handleEvent(event({ op: 'restore', phase: 'kill', percent: 10 }));
      slow.handleEvent(event({ op: 'restore', phase: 'restore', percent: 60 }));
      expect(update).not.toHaveBeenCalled();
      jest.advanceTimersByTime(250);
      expect(update).toHaveBeenCalledTimes(1); // coalesced: the latest only
      expect(notifier.notes[0].message).toMatch(/^R: Restoring the process/);
      handle.succeed('R done');
      expect(notifier.notes[0]).toMatchObject({
        type: 'success',
        message: 'R done'
      });
      jest.advanceTimersByTime(1000);
      expect(update).toHaveBeenCalledTimes(3); // final state re-applied
      expect(notifier.notes[0]).toMatchObject({
        type: 'success',
        message: 'R done'
      });
      // and again later, for a toast a loaded browser showed late
      jest.advanceTimersByTime(3000);
      expect(update).toHaveBeenCalledTimes(4);
      jest.advanceTimersByTime(12000);
      expect(update).toHaveBeenCalledTimes(5);
      jest.advanceTimersByTime(60000);
      expect(update).toHaveBeenCalledTimes(5);
      expect(notifier.notes[0]).toMatchObject({
        type: 'success',
        message: 'R done'
      });
    } finally {
      jest.useRealTimers();
    }
  });

  it('draws a text progress bar', () => {
    expect(progressBar(0)).toBe('░░░░░░░░░░');
    expect(progressBar(55)).toBe('██████░░░░');
    expect(progressBar(100)).toBe('██████████');
    expect(progressBar(250)).toBe('██████████');
  });

  it('cuts long messages', () => {
    tracker.begin('snapshot', 'k1', 'x'.repeat(300));
    expect(notifier.notes[0].message.length).toBeLessThanOrEqual(140);
  });
});

describe('failureText', () => {
  it('keeps the reason when the message is long', () => {
    const text = failureText(
      'Restore of a.ipynb',
      'x'.repeat(300),
      'criu_failed'
    );
    expect(text.length).toBe(140);
    expect(text.startsWith('Restore of a.ipynb failed: xxx')).toBe(true);
    expect(text.endsWith('x… (criu_failed)')).toBe(true);
    expect(failureText('S', 'disk full', 'store_failed')).toBe(
      'S failed: disk full (store_failed)'
    );
    expect(failureText('S', 'boom')).toBe('S failed: boom');
  });

  it('says busy and cancelled short, whole within 140 characters', () => {
    const busy = failureText(
      'Snapshot of a-notebook-with-a-rather-long-name.ipynb',
      'the kernel stayed busy for 30 s: wait for the running cell to finish (or interrupt it) and try again',
      'kernel_busy'
    );
    expect(busy).toBe(
      'Snapshot of a-notebook-with-a-rather-long-name.ipynb failed: the kernel is running a cell: interrupt it or retry when it ends (kernel_busy)'
    );
    expect(busy.length).toBeLessThanOrEqual(140);
    expect(
      failureText('Snapshot of nb.ipynb', 'cancelled while...', 'cancelled')
    ).toBe('Snapshot of nb.ipynb cancelled: the running cell goes on');
  });

  it('passes the full error to the notifier for a details action', () => {
    const notifier = new FakeNotifier();
    const tracker = new ProgressTracker({ notifier, settleMs: 0 });
    const handle = tracker.begin('snapshot', 'k', 'S');
    const long = 'y'.repeat(500);
    handle.fail(new InfinijupRequestError(long, 'criu_failed', 500));
    expect((notifier.notes[0] as any).details).toEqual({
      title: 'S failed',
      message: long,
      reason: 'criu_failed'
    });
  });
});

describe('parseOperationEvent', () => {
  it('accepts operation events and clamps percent', () => {
    const ev = parseOperationEvent({
      schema_id: EVENT_SCHEMA_ID,
      op: 'snapshot',
      op_id: 'o',
      kernel_id: 'k',
      path: 'p',
      phase: 'store',
      percent: 140,
      message: 'm'
    });
    expect(ev).toMatchObject({ op: 'snapshot', percent: 100, phase: 'store' });
    expect(ev!.quiet).toBe(false);
  });

  it('reads quiet: an automatic snapshot or a step of an undo (issue 30)', () => {
    const ev = parseOperationEvent({
      schema_id: EVENT_SCHEMA_ID,
      op: 'restore',
      op_id: 'o',
      kernel_id: 'k',
      phase: 'done',
      quiet: true
    });
    expect(ev!.quiet).toBe(true);
  });

  it('rejects other schemas and malformed events', () => {
    expect(
      parseOperationEvent({ schema_id: 'other', op: 'snapshot' })
    ).toBeNull();
    expect(
      parseOperationEvent({
        schema_id: EVENT_SCHEMA_ID,
        op: 'delete',
        op_id: 'o',
        kernel_id: 'k',
        phase: 'x'
      })
    ).toBeNull();
  });
});
