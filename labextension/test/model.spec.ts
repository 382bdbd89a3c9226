import { InfinijupRequestError } from '../src/errors';
import { HistoryModel } from '../src/model';
import type {
  IHistory,
  IHistoryQuery,
  IInfinijupAPI,
  IOperationEvent
} from '../src/types';
import { commit, linearHistory } from './synthetic';

/** A controllable fake of the server API. */
class FakeAPI implements IInfinijupAPI {
  queries: IHistoryQuery[] = [];
  histories: IHistory[] = [];
  pending: {
    resolve: (h: IHistory) => void;
    reject: (e: Error) => void;
  }[] = [];
  manual = false;
  error: Error | null = null;

  history(query: IHistoryQuery): Promise<IHistory> {
    this.queries.push(query);
    if (this.manual) {
      return new Promise((resolve, reject) =>
        this.pending.push({ resolve, reject })
      );
    }
    if (this.error) {
      return Promise.reject(this.error);
    }
    return Promise.resolve(this.histories.shift() ?? this.current);
  }

  current: IHistory = { commits: [], threads: {}, head: null };

  snapshot = jest.fn();
  restore = jest.fn();
  branch = jest.fn();
  resume = jest.fn();
  status = jest.fn();
}

function history(commits = linearHistory(3)): IHistory {
  return {
    commits,
    threads: { main: commits[0]?.id },
    head: { thread: 'main', commit: commits[0]?.id ?? null }
  };
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

const flush = () => new Promise(resolve => setTimeout(resolve, 0));

describe('HistoryModel', () => {
  let api: FakeAPI;
  let model: HistoryModel;

  beforeEach(() => {
    api = new FakeAPI();
    api.current = history();
    model = new HistoryModel({ api, refreshDelay: 0 });
  });

  afterEach(() => model.dispose());

  it('starts empty', () => {
    expect(model.state).toBe('empty');
    expect(model.commits).toEqual([]);
    expect(model.layout.rows).toEqual([]);
  });

  it('loads the history of a kernel', async () => {
    const kinds: string[] = [];
    model.changed.connect((_, kind) => kinds.push(kind));
    model.setTarget({ path: 'nb.ipynb', kernelId: 'k1' });
    expect(model.state).toBe('loading');
    await flush();
    expect(api.queries).toEqual([{ kernel_id: 'k1' }]);
    expect(model.state).toBe('ready');
    expect(model.commits.map(c => c.id)).toEqual(['c2', 'c1', 'c0']);
    expect(model.head).toEqual({ thread: 'main', commit: 'c2' });
    expect(model.tips.get('c2')).toEqual(['main']);
    expect(model.layout.rows).toHaveLength(3);
    expect(kinds).toContain('target');
    expect(kinds[kinds.length - 1]).toBe('history');
  });

  it('loads by path when the notebook has no kernel', async () => {
    model.setTarget({ path: 'dir/nb.ipynb', kernelId: null });
    await flush();
    expect(api.queries).toEqual([{ path: 'dir/nb.ipynb' }]);
  });

  it('does nothing when the target does not change', async () => {
    model.setTarget({ path: 'nb.ipynb', kernelId: 'k1' });
    model.setTarget({ path: 'nb.ipynb', kernelId: 'k1' });
    await flush();
    expect(api.queries).toHaveLength(1);
  });

  it('keeps the history when only the kernel changes', async () => {
    model.setTarget({ path: 'nb.ipynb', kernelId: null });
    await flush();
    api.manual = true;
    model.setTarget({ path: 'nb.ipynb', kernelId: 'k2' });
    expect(model.commits).toHaveLength(3);
    expect(model.loading).toBe(true);
    expect(api.queries[1]).toEqual({ kernel_id: 'k2' });
  });

  it('drops replies for an older target', async () => {
    api.manual = true;
    model.setTarget({ path: 'a.ipynb', kernelId: 'ka' });
    model.setTarget({ path: 'b.ipynb', kernelId: 'kb' });
    const [first, second] = api.pending;
    second.resolve(history([commit('b', [], 'main', 1)]));
    await flush();
    first.resolve(history([commit('a', [], 'main', 1)]));
    await flush();
    expect(model.commits.map(c => c.id)).toEqual(['b']);
    expect(model.target!.path).toBe('b.ipynb');
  });

  it('reports errors with the server reason', async () => {
    api.error = new InfinijupRequestError(
      'Unknown kernel k9',
      'not_found',
      404
    );
    model.setTarget({ path: 'nb.ipynb', kernelId: 'k9' });
    await flush();
    expect(model.state).toBe('error');
    expect(model.error!.reason).toBe('not_found');
    expect(model.error!.describe()).toBe('Unknown kernel k9 (not_found)');
    api.error = null;
    await model.refresh();
    expect(model.state).toBe('ready');
    expect(model.error).toBeNull();
  });

  it('turns unknown failures into request errors', async () => {
    api.error = new Error('boom');
    model.setTarget({ path: 'nb.ipynb', kernelId: 'k1' });
    await flush();
    expect(model.error).toBeInstanceOf(InfinijupRequestError);
    expect(model.error!.message).toBe('boom');
  });

  describe('events', () => {
    beforeEach(async () => {
      model.setTarget({ path: 'nb.ipynb', kernelId: 'k1' });
      await flush();
      api.queries = [];
    });

    it('ignores events of other notebooks', () => {
      model.handleEvent(event({ kernel_id: 'other', path: 'other.ipynb' }));
      expect(model.operation).toBeNull();
    });

    it('matches events by kernel or by path', () => {
      expect(model.isTargetEvent(event({ path: '' }))).toBe(true);
      expect(model.isTargetEvent(event({ kernel_id: 'k2' }))).toBe(true);
      expect(
        model.isTargetEvent(event({ kernel_id: 'k2', path: 'x.ipynb' }))
      ).toBe(false);
    });

    it('tracks the running operation', () => {
      model.handleEvent(event({ phase: 'quiesce', percent: 5 }));
      expect(model.operation!.phase).toBe('quiesce');
      model.handleEvent(event({ phase: 'store', percent: 80 }));
      expect(model.operation!.percent).toBe(80);
      model.handleEvent(event({ phase: 'error', reason: 'criu_failed' }));
      expect(model.operation).toBeNull();
    });

    it('reloads once after a burst of done events (a %snapshot, another tab)', async () => {
      api.current = history(linearHistory(4));
      model.handleEvent(event({ phase: 'done', commit: 'c3', thread: 'main' }));
      model.handleEvent(
        event({ op_id: 'op2', phase: 'done', commit: 'c3', thread: 'main' })
      );
      await flush();
      await flush();
      expect(api.queries).toHaveLength(1);
      expect(model.commits).toHaveLength(4);
    });

    it('moves the head at once when a restore finishes', () => {
      model.handleEvent(
        event({ op: 'restore', phase: 'done', commit: 'c0', thread: 'alt' })
      );
      expect(model.head).toEqual({
        thread: 'alt',
        commit: 'c0',
        next_thread: null
      });
    });

    it('does not reload on an error event', async () => {
      model.handleEvent(event({ phase: 'error' }));
      await flush();
      expect(api.queries).toHaveLength(0);
    });
  });

  describe('commits and selection', () => {
    beforeEach(async () => {
      api.current = history([
        commit('abcdef0123', ['1234567890'], 'main', 2),
        commit('abcd999999', ['1234567890'], 'x', 3),
        commit('1234567890', [], 'main', 1)
      ]);
      api.current.threads = { main: 'abcdef0123', x: 'abcd999999' };
      model.setTarget({ path: 'nb.ipynb', kernelId: 'k1' });
      await flush();
    });

    it('finds commits by id, unique prefix or thread', () => {
      expect(model.getCommit('abcdef0123')!.id).toBe('abcdef0123');
      expect(model.getCommit('abcdef')!.id).toBe('abcdef0123');
      expect(model.getCommit('abcd')).toBeUndefined(); // ambiguous
      expect(model.getCommit('x')!.id).toBe('abcd999999');
      expect(model.getCommit('nope')).toBeUndefined();
      expect(model.getCommit(null)).toBeUndefined();
    });

    it('selects and forgets vanished selections', async () => {
      model.select('abcd999999');
      expect(model.selected).toBe('abcd999999');
      api.current = history([commit('1234567890', [], 'main', 1)]);
      await model.refresh();
      expect(model.selected).toBeNull();
    });
  });

  describe('collapsing', () => {
    beforeEach(async () => {
      api.current = history(linearHistory(40));
      model.setTarget({ path: 'nb.ipynb', kernelId: 'k1' });
      await flush();
    });

    it('collapses long runs by default and reveals hidden commits', () => {
      expect(model.layout.rows.length).toBeLessThan(10);
      expect(model.layout.hiddenCount).toBeGreaterThan(30);
      const row = model.reveal('c10');
      expect(model.layout.hiddenCount).toBe(0);
      expect(model.layout.rows[row!].node.id).toBe('c10');
      model.collapseAll();
      expect(model.layout.hiddenCount).toBeGreaterThan(30);
    });

    it('can be turned off', () => {
      const kinds: string[] = [];
      model.changed.connect((_, k) => kinds.push(k));
      model.collapse = false;
      expect(kinds).toEqual(['layout']);
      expect(model.layout.rows).toHaveLength(40);
    });

    it('never hides the head', async () => {
      api.current = history(linearHistory(40));
      api.current.head = { thread: 'main', commit: 'c20' };
      await model.refresh();
      expect(model.layout.rows[model.layout.rowOf.get('c20')!].node.id).toBe(
        'c20'
      );
    });
  });
  describe('search', () => {
    beforeEach(async () => {
      const commits = linearHistory(40);
      commits[35].metadata = {
        variables: {
          items: [
            {
              name: 'weights',
              type: 'ndarray',
              size: 8,
              shape: '(1,)',
              fp: 'f',
              changed: true
            }
          ],
          truncated: false
        }
      };
      api.current = history(commits);
      model.setTarget({ path: 'nb.ipynb', kernelId: 'k1' });
      await flush();
    });

    it('finds commits by variable name and never folds a match away', () => {
      const hidden = model.layout.hiddenCount;
      expect(hidden).toBeGreaterThan(30);
      expect(model.matches).toBeNull();
      expect(model.isMatch('c0')).toBe(true);
      const kinds: string[] = [];
      model.changed.connect((_, k) => kinds.push(k));
      model.query = 'weights';
      expect(kinds).toEqual(['layout']);
      expect(model.matches).toEqual(['c4']);
      expect(model.isMatch('c4')).toBe(true);
      expect(model.isMatch('c5')).toBe(false);
      // c4 sits in the folded run: it is pinned, so it has a row of its own.
      expect(model.layout.rows[model.layout.rowOf.get('c4')!].node.id).toBe(
        'c4'
      );
      model.query = 'commit c1';
      expect(model.matches).toEqual([
        'c19',
        'c18',
        'c17',
        'c16',
        'c15',
        'c14',
        'c13',
        'c12',
        'c11',
        'c10',
        'c1'
      ]);
      model.query = '  ';
      expect(model.matches).toBeNull();
    });
  });

  describe('compare', () => {
    beforeEach(async () => {
      model.setTarget({ path: 'nb.ipynb', kernelId: 'k1' });
      await flush();
    });

    it('picks the commit to compare with on the next selection', () => {
      model.select('c2');
      model.picking = true;
      expect(model.picking).toBe(true);
      model.select('c0');
      expect(model.selected).toBe('c2');
      expect(model.compareWith).toBe('c0');
      expect(model.picking).toBe(false);
      // Selecting another commit ends the comparison.
      model.select('c1');
      expect(model.compareWith).toBeNull();
      // Comparing a commit with itself is no comparison.
      model.setCompare('c1');
      expect(model.compareWith).toBeNull();
      model.setCompare('c2');
      expect(model.compareWith).toBe('c2');
      model.setCompare(null);
      expect(model.compareWith).toBeNull();
    });
  });

  describe('next snapshot', () => {
    it('follows the server, or plans like it after a restore event', async () => {
      api.current = {
        ...history(),
        head: { thread: 'main', commit: 'c2', next_thread: 'main' }
      };
      model.setTarget({ path: 'nb.ipynb', kernelId: 'k1' });
      await flush();
      expect(model.nextSnapshot).toEqual({
        thread: 'main',
        isNew: false,
        parent: 'c2'
      });
      // A restore of c0 (not a tip): the event says no thread.
      model.handleEvent(
        event({ op: 'restore', phase: 'done', commit: 'c0', thread: '' })
      );
      expect(model.head).toEqual({
        thread: null,
        commit: 'c0',
        next_thread: null
      });
      expect(model.nextSnapshot).toEqual({
        thread: 'main-1',
        isNew: true,
        parent: 'c0'
      });
    });

    it('is unknown without a kernel', async () => {
      model.setTarget({ path: 'nb.ipynb', kernelId: null });
      await flush();
      expect(model.commits).toHaveLength(3);
      expect(model.nextSnapshot).toBeNull();
    });

    it('reloads a kernel-less history when a resume of its notebook ends', async () => {
      model.setTarget({ path: 'nb.ipynb', kernelId: null });
      await flush();
      model.handleEvent(
        event({
          op: 'resume',
          kernel_id: 'new',
          phase: 'done',
          commit: 'c1',
          thread: 'main'
        })
      );
      await flush();
      await flush();
      expect(api.queries).toEqual([{ path: 'nb.ipynb' }, { path: 'nb.ipynb' }]);
    });
  });
});
