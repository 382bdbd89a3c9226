import {
  COLLAPSED_PREFIX,
  IGraphLayout,
  layoutGraph,
  nodeCommits
} from '../src/layout';
import type { ICommit } from '../src/types';
import { commit, linearHistory, syntheticHistory } from './synthetic';

/** Row ids, for readable assertions. */
function ids(layout: IGraphLayout<ICommit>): string[] {
  return layout.rows.map(r => r.node.id);
}

function lanes(layout: IGraphLayout<ICommit>): { [id: string]: number } {
  const out: { [id: string]: number } = {};
  for (const r of layout.rows) {
    out[r.node.id] = r.lane;
  }
  return out;
}

/**
 * Invariants every layout must satisfy:
 * - a node is above all of its parents;
 * - each edge leaves its child (out), crosses the rows between (through) and
 *   enters its parent (into) in one lane;
 * - no line crosses a node: the node's lane is not used by `through` in its row;
 * - two lines never share a lane in one row.
 */
function checkInvariants(layout: IGraphLayout<ICommit>): void {
  const { rows, rowOf, laneCount } = layout;
  let outs = 0;
  let intos = 0;
  rows.forEach((row, r) => {
    expect(row.lane).toBeGreaterThanOrEqual(0);
    expect(row.lane).toBeLessThan(laneCount);
    for (const seg of [...row.into, ...row.out, ...row.through]) {
      expect(seg.lane).toBeLessThan(laneCount);
    }
    expect(row.through.map(s => s.lane)).not.toContain(row.lane);
    const through = row.through.map(s => s.lane);
    expect(new Set(through).size).toBe(through.length);
    for (const p of row.node.parents) {
      expect(rowOf.get(p)!).toBeGreaterThan(r);
    }
    outs += row.out.filter(s => !s.dangling).length;
    intos += row.into.length;
  });
  expect(intos).toBe(outs);
}

describe('layoutGraph', () => {
  it('lays out nothing', () => {
    const layout = layoutGraph([]);
    expect(layout.rows).toEqual([]);
    expect(layout.laneCount).toBe(0);
    expect(layout.hiddenCount).toBe(0);
  });

  it('draws a linear history in one lane, newest first', () => {
    const layout = layoutGraph(linearHistory(5));
    expect(ids(layout)).toEqual(['c4', 'c3', 'c2', 'c1', 'c0']);
    expect(layout.laneCount).toBe(1);
    expect(layout.rows.map(r => r.lane)).toEqual([0, 0, 0, 0, 0]);
    // top commit: a line out, none in; root: a line in, none out.
    expect(layout.rows[0].into).toEqual([]);
    expect(layout.rows[0].out).toEqual([{ lane: 0, color: 0 }]);
    expect(layout.rows[4].into).toEqual([{ lane: 0, color: 0 }]);
    expect(layout.rows[4].out).toEqual([]);
    checkInvariants(layout);
  });

  it('gives a branch its own lane and joins it at the fork point', () => {
    // main: A <- B <- C; x: A <- X1 <- X2, interleaved in time.
    const commits = [
      commit('X2', ['X1'], 'x', 5),
      commit('C', ['B'], 'main', 4),
      commit('X1', ['A'], 'x', 3),
      commit('B', ['A'], 'main', 2),
      commit('A', [], 'main', 1)
    ];
    const layout = layoutGraph(commits);
    expect(ids(layout)).toEqual(['X2', 'C', 'X1', 'B', 'A']);
    expect(lanes(layout)).toEqual({ X2: 1, C: 0, X1: 1, B: 0, A: 0 });
    expect(layout.laneCount).toBe(2);
    const rowB = layout.rows[3];
    expect(rowB.through.map(s => s.lane)).toEqual([1]);
    const rowA = layout.rows[4];
    expect(rowA.into.map(s => s.lane).sort()).toEqual([0, 1]);
    expect(layout.threadLanes.get('main')).toBe(0);
    expect(layout.threadLanes.get('x')).toBe(1);
    expect(layout.threadColors.get('main')).not.toBe(
      layout.threadColors.get('x')
    );
    checkInvariants(layout);
  });

  it('puts the thread with the oldest history in lane 0 even if its tip is older', () => {
    const commits = [
      commit('X1', ['A'], 'x', 3),
      commit('B', ['A'], 'main', 2),
      commit('A', [], 'main', 1)
    ];
    const layout = layoutGraph(commits);
    expect(lanes(layout)).toEqual({ X1: 1, B: 0, A: 0 });
  });

  it('keeps children above parents when clocks disagree', () => {
    const commits = [
      commit('P', [], 'main', 10),
      commit('C', ['P'], 'main', 5) // older timestamp than its parent
    ];
    const layout = layoutGraph(commits);
    expect(ids(layout)).toEqual(['C', 'P']);
    checkInvariants(layout);
  });

  it('orders equal timestamps by input order', () => {
    const commits = [
      commit('b2', ['b1'], 'b', 7),
      commit('a2', ['a1'], 'a', 7),
      commit('b1', [], 'b', 1),
      commit('a1', [], 'a', 1)
    ];
    expect(ids(layoutGraph(commits))).toEqual(['b2', 'a2', 'b1', 'a1']);
  });

  it('marks lines to parents that are not loaded', () => {
    const layout = layoutGraph([commit('c', ['missing'], 'main', 1)]);
    expect(layout.rows[0].node.dangling).toBe(true);
    expect(layout.rows[0].out).toEqual([{ lane: 0, color: 0, dangling: true }]);
    expect(layout.rows[0].node.parents).toEqual([]);
  });

  it('ignores duplicate ids', () => {
    const c = commit('a', [], 'main', 1);
    const layout = layoutGraph([c, { ...c, message: 'dup' }]);
    expect(layout.rows).toHaveLength(1);
    expect((layout.rows[0].node as any).commit.message).toBe(c.message);
  });

  it('reuses the lane of a finished thread', () => {
    // main: m1..m6; a: from m1, commits at 2-3; b: from m4, commits at 6.5-7.
    const commits = [
      commit('b2', ['b1'], 'b', 7.5),
      commit('b1', ['m4'], 'b', 6.5),
      commit('m6', ['m5'], 'main', 6),
      commit('m5', ['m4'], 'main', 5),
      commit('m4', ['m3'], 'main', 4),
      commit('a2', ['a1'], 'a', 3.5),
      commit('m3', ['m2'], 'main', 3),
      commit('a1', ['m1'], 'a', 2.5),
      commit('m2', ['m1'], 'main', 2),
      commit('m1', [], 'main', 1)
    ];
    const layout = layoutGraph(commits);
    expect(layout.laneCount).toBe(2);
    expect(lanes(layout)['a1']).toBe(1);
    expect(lanes(layout)['b1']).toBe(1);
    checkInvariants(layout);
  });

  it('continues a thread on its newest line when it forks', () => {
    // restore to m1 without a branch, then snapshot: main forks from m1.
    const commits = [
      commit('n1', ['m1'], 'main', 4),
      commit('m3', ['m2'], 'main', 3),
      commit('m2', ['m1'], 'main', 2),
      commit('m1', [], 'main', 1)
    ];
    const layout = layoutGraph(commits);
    // n1 (the live line) continues main in lane 0; the older m3-m2 moves aside.
    expect(lanes(layout)).toEqual({ n1: 0, m3: 1, m2: 1, m1: 0 });
    checkInvariants(layout);
  });

  it('draws merges in an extra lane', () => {
    const commits = [
      commit('M', ['B', 'X1'], 'main', 4),
      commit('X1', ['A'], 'x', 3),
      commit('B', ['A'], 'main', 2),
      commit('A', [], 'main', 1)
    ];
    const layout = layoutGraph(commits);
    expect(ids(layout)).toEqual(['M', 'X1', 'B', 'A']);
    const m = layout.rows[0];
    expect(m.out).toHaveLength(2);
    checkInvariants(layout);
  });

  describe('collapsing linear runs', () => {
    const options = {
      collapse: { minRun: 10, keepRecent: 3 },
      pinned: ['c29']
    };

    it('collapses the middle of a long run', () => {
      const layout = layoutGraph(linearHistory(30), options);
      expect(ids(layout)).toEqual([
        'c29',
        'c28',
        'c27',
        'c26',
        COLLAPSED_PREFIX + 'c1',
        'c0'
      ]);
      const node = layout.rows[4].node;
      expect(node.kind).toBe('collapsed');
      expect(nodeCommits(node).map(c => c.id)).toEqual(
        Array.from({ length: 25 }, (_, i) => `c${25 - i}`)
      );
      expect(layout.hiddenCount).toBe(25);
      expect(layout.rowOf.get('c10')).toBe(4);
      expect(layout.rowOf.get('c0')).toBe(5);
      checkInvariants(layout);
    });

    it('expands a run by key', () => {
      const layout = layoutGraph(linearHistory(30), {
        ...options,
        collapse: { ...options.collapse, expanded: new Set(['c1']) }
      });
      expect(layout.rows).toHaveLength(30);
      expect(layout.hiddenCount).toBe(0);
    });

    it('leaves short runs alone', () => {
      expect(layoutGraph(linearHistory(11), options).rows).toHaveLength(11);
      expect(layoutGraph(linearHistory(12), options).rows).toHaveLength(6);
      expect(layoutGraph(linearHistory(30), {}).rows).toHaveLength(30);
    });

    it('never hides pinned commits, fork points or thread boundaries', () => {
      const main = linearHistory(40); // c0..c39
      const commits = [commit('x1', ['c20'], 'x', 100), ...main];
      const layout = layoutGraph(commits, {
        collapse: { minRun: 5, keepRecent: 1 },
        pinned: ['c39', 'c30']
      });
      const visible = new Set(ids(layout));
      for (const id of ['c39', 'c30', 'c20', 'x1', 'c0']) {
        expect(visible.has(id)).toBe(true);
      }
      // runs: c38..c31 (8), c29..c21 (9), c19..c1 (19)
      const collapsed = layout.rows.filter(r => r.node.kind === 'collapsed');
      expect(collapsed.map(r => (r.node as any).key)).toEqual([
        'c31',
        'c21',
        'c1'
      ]);
      expect(layout.hiddenCount).toBe(7 + 8 + 18);
      checkInvariants(layout);
    });
  });

  describe('synthetic histories', () => {
    it.each([
      [200, 1],
      [1000, 2],
      [1000, 3]
    ])('%i commits (seed %i) satisfy the invariants', (n, seed) => {
      const history = syntheticHistory(n, { seed, maxThreads: 8 });
      const layout = layoutGraph(history.commits);
      expect(layout.rows).toHaveLength(n);
      expect(layout.laneCount).toBeLessThanOrEqual(12);
      checkInvariants(layout);

      const collapsed = layoutGraph(history.commits, {
        collapse: { minRun: 6, keepRecent: 2 },
        pinned: [...Object.values(history.threads), history.head!.commit!]
      });
      expect(
        collapsed.rows.length +
          collapsed.hiddenCount -
          collapsed.rows.filter(r => r.node.kind === 'collapsed').length
      ).toBe(n);
      for (const c of history.commits) {
        expect(collapsed.rowOf.has(c.id)).toBe(true);
      }
      checkInvariants(collapsed);
    });

    it('collapses a long single-thread history to a handful of rows', () => {
      const history = syntheticHistory(1000, { branchRate: 0 });
      const layout = layoutGraph(history.commits, {
        collapse: { minRun: 10, keepRecent: 3 },
        pinned: [history.head!.commit!]
      });
      expect(layout.rows).toHaveLength(6);
      expect(layout.hiddenCount).toBe(995);
    });
  });
});
