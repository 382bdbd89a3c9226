/**
 * Graph layout of a commit DAG: commits -> rows, lanes and edge segments.
 *
 * Pure functions, no DOM and no JupyterLab: the history panel draws the result
 * row by row (so it can render only the visible rows), and the unit tests check
 * it directly.
 *
 * The layout:
 * - rows: one per visible node, newest first, and always below all of its
 *   children (a topological order that follows creation time where it can);
 * - chains: maximal first-parent runs of commits of the same thread; a chain
 *   is drawn in one lane from its newest commit down to the row of the parent
 *   of its oldest commit, where it joins the parent's lane;
 * - lanes: one lane per thread where possible (a thread keeps the lane of its
 *   first chain; threads that do not overlap in rows share lanes); threads whose
 *   history is older get the lanes on the left, so the root thread is lane 0;
 * - extra parents (merges) get a lane of their own for the rows they span;
 * - long linear runs (commits with one parent and one child, all on one thread)
 *   are collapsed into one node, except the newest `keepRecent` of the run and
 *   commits that are pinned (head, thread tips); a collapsed run is expanded by
 *   putting its key in `expanded`.
 */

/** The fields of a commit the layout needs. */
export interface IGraphCommit {
  id: string;
  parents: readonly string[];
  thread: string;
  /** Creation time (any monotonic unit, larger is newer). */
  created: number;
}

/** A visible commit. */
export interface ICommitNode<T extends IGraphCommit> {
  kind: 'commit';
  id: string;
  thread: string;
  created: number;
  commit: T;
  /** Parent node ids present in the graph (redirected to collapsed nodes). */
  parents: string[];
  /** True when a parent is not in the loaded history. */
  dangling: boolean;
}

/** A collapsed linear run of commits. */
export interface ICollapsedNode<T extends IGraphCommit> {
  kind: 'collapsed';
  id: string;
  /** Stable key of the run (id of its oldest commit), for `expanded`. */
  key: string;
  thread: string;
  created: number;
  /** The hidden commits, newest first. */
  commits: T[];
  parents: string[];
  dangling: boolean;
}

export type GraphNode<T extends IGraphCommit> =
  ICommitNode<T> | ICollapsedNode<T>;

/** A line drawn in one lane of a row. */
export interface ISegment {
  lane: number;
  /** Color index (0 .. colors-1). */
  color: number;
  /** The line leads to a parent that is not loaded. */
  dangling?: boolean;
}

/** One row of the graph. */
export interface ILayoutRow<T extends IGraphCommit> {
  node: GraphNode<T>;
  /** Lane of the node. */
  lane: number;
  /** Color index of the node (its thread's). */
  color: number;
  /** Lines from the top of the row into the node, by the lane they come from. */
  into: ISegment[];
  /** Lines from the node to the bottom of the row, by the lane they go to. */
  out: ISegment[];
  /** Vertical lines crossing the whole row. */
  through: ISegment[];
}

export interface IGraphLayout<T extends IGraphCommit> {
  rows: ILayoutRow<T>[];
  laneCount: number;
  /** Node id -> row; ids of hidden commits map to the row of their collapsed node. */
  rowOf: Map<string, number>;
  /** Thread -> color index. */
  threadColors: Map<string, number>;
  /** Thread -> its preferred lane. */
  threadLanes: Map<string, number>;
  /** Number of commits hidden in collapsed nodes. */
  hiddenCount: number;
}

export interface ICollapseOptions {
  /** Collapse runs of at least this many collapsible commits (>= 2). */
  minRun: number;
  /** Keep this many of the newest commits of a run visible (default 3). */
  keepRecent?: number;
  /** Keys of runs the user expanded. */
  expanded?: ReadonlySet<string>;
}

export interface ILayoutOptions {
  /** Collapse long linear runs (off when null or absent). */
  collapse?: ICollapseOptions | null;
  /** Commits that are never hidden (head, thread tips). */
  pinned?: Iterable<string>;
  /** Size of the color palette (default 8). */
  colors?: number;
}

/** The prefix of collapsed node ids. */
export const COLLAPSED_PREFIX = 'collapsed:';

/**
 * Lay out a commit DAG.
 *
 * @param commits - the commits, any order (the server sends newest first);
 *   duplicate ids are ignored after the first.
 */
export function layoutGraph<T extends IGraphCommit>(
  commits: readonly T[],
  options: ILayoutOptions = {}
): IGraphLayout<T> {
  const palette = Math.max(1, options.colors ?? 8);

  // 1. Index the commits.
  const byId = new Map<string, number>();
  const list: T[] = [];
  for (const c of commits) {
    if (!byId.has(c.id)) {
      byId.set(c.id, list.length);
      list.push(c);
    }
  }
  const n = list.length;

  // 2. Collapse long linear runs.
  const redirect = new Map<string, string>();
  const collapsed: ICollapsedNode<T>[] = [];
  const collapsedOrder: number[] = [];
  let hiddenCount = 0;
  if (options.collapse && options.collapse.minRun >= 2 && n > 0) {
    hiddenCount = collapseRuns(
      list,
      byId,
      options.collapse,
      new Set(options.pinned ?? []),
      redirect,
      collapsed,
      collapsedOrder
    );
  }

  // 3. Build the nodes, parents resolved (through collapsed runs).
  const nodes: GraphNode<T>[] = [];
  const order: number[] = []; // input order, for stable ties
  const nodeIndex = new Map<string, number>();
  const resolve = (parents: readonly string[]) => {
    const out: string[] = [];
    let dangling = false;
    for (const p of parents) {
      const target = redirect.get(p) ?? p;
      if (byId.has(p)) {
        if (!out.includes(target)) {
          out.push(target);
        }
      } else {
        dangling = true;
      }
    }
    return { parents: out, dangling };
  };
  for (let i = 0; i < n; i++) {
    const c = list[i];
    if (redirect.has(c.id)) {
      continue;
    }
    const { parents, dangling } = resolve(c.parents);
    nodeIndex.set(c.id, nodes.length);
    nodes.push({
      kind: 'commit',
      id: c.id,
      thread: c.thread,
      created: c.created,
      commit: c,
      parents,
      dangling
    });
    order.push(i);
  }
  collapsed.forEach((node, k) => {
    const oldest = node.commits[node.commits.length - 1];
    const { parents, dangling } = resolve(oldest.parents);
    node.parents = parents;
    node.dangling = dangling;
    nodeIndex.set(node.id, nodes.length);
    nodes.push(node);
    order.push(collapsedOrder[k]);
  });
  const m = nodes.length;

  // Parent indices of each node.
  const parentIdx: number[][] = nodes.map(node =>
    node.parents
      .map(p => nodeIndex.get(p))
      .filter((x): x is number => x !== undefined)
  );

  // 4. Rows: topological (children above parents), newest first.
  const rowNodes = topoOrder(nodes, order, parentIdx);
  const rowOfNode = new Int32Array(m);
  rowNodes.forEach((nodeI, row) => (rowOfNode[nodeI] = row));

  // 5. Thread ranks and colors: threads with older history go left.
  const threadOldest = new Map<string, number>();
  for (const node of nodes) {
    const created =
      node.kind === 'collapsed'
        ? node.commits[node.commits.length - 1].created
        : node.created;
    const prev = threadOldest.get(node.thread);
    if (prev === undefined || created < prev) {
      threadOldest.set(node.thread, created);
    }
  }
  const threads = [...threadOldest.keys()].sort((a, b) => {
    const d = threadOldest.get(a)! - threadOldest.get(b)!;
    return d !== 0 ? d : a < b ? -1 : a > b ? 1 : 0;
  });
  const threadRank = new Map<string, number>();
  const threadColors = new Map<string, number>();
  threads.forEach((t, i) => {
    threadRank.set(t, i);
    threadColors.set(t, i % palette);
  });

  // 6. Chains, in row order.
  const chainOf = new Int32Array(m).fill(-1);
  const pendingChain = new Int32Array(m).fill(-1); // by row
  const chains: {
    thread: string;
    top: number;
    bottom: number;
    end: number;
    lane: number;
  }[] = [];
  for (let row = 0; row < m; row++) {
    const nodeI = rowNodes[row];
    const node = nodes[nodeI];
    let chain = pendingChain[row];
    if (chain === -1) {
      chain = chains.length;
      chains.push({
        thread: node.thread,
        top: row,
        bottom: row,
        end: row,
        lane: -1
      });
    }
    chainOf[nodeI] = chain;
    chains[chain].bottom = row;
    const first = parentIdx[nodeI][0];
    if (first !== undefined) {
      const prow = rowOfNode[first];
      chains[chain].end = prow;
      if (nodes[first].thread === node.thread && pendingChain[prow] === -1) {
        pendingChain[prow] = chain;
      }
    } else {
      chains[chain].end = row;
    }
  }

  // 7. Lanes.
  const lanes = new LaneAllocator();
  const threadLanes = new Map<string, number>();
  const chainOrder = chains
    .map((_, i) => i)
    .sort((a, b) => {
      const d =
        threadRank.get(chains[a].thread)! - threadRank.get(chains[b].thread)!;
      return d !== 0 ? d : chains[a].top - chains[b].top;
    });
  for (const ci of chainOrder) {
    const chain = chains[ci];
    const pref = threadLanes.get(chain.thread);
    chain.lane = lanes.allocate(chain.top, chain.end, pref);
    if (pref === undefined) {
      threadLanes.set(chain.thread, chain.lane);
    }
  }

  // 8. Rows and segments.
  const rows: ILayoutRow<T>[] = rowNodes.map(nodeI => {
    const node = nodes[nodeI];
    return {
      node,
      lane: chains[chainOf[nodeI]].lane,
      color: threadColors.get(node.thread)!,
      into: [],
      out: [],
      through: []
    };
  });
  const addEdge = (from: number, to: number, lane: number, color: number) => {
    rows[from].out.push({ lane, color });
    for (let r = from + 1; r < to; r++) {
      rows[r].through.push({ lane, color });
    }
    if (to > from) {
      rows[to].into.push({ lane, color });
    }
  };
  for (let row = 0; row < m; row++) {
    const nodeI = rowNodes[row];
    const node = nodes[nodeI];
    const r = rows[row];
    const parents = parentIdx[nodeI];
    if (parents.length > 0) {
      addEdge(row, rowOfNode[parents[0]], r.lane, r.color);
    } else if (node.dangling) {
      r.out.push({ lane: r.lane, color: r.color, dangling: true });
    }
    for (let k = 1; k < parents.length; k++) {
      const prow = rowOfNode[parents[k]];
      const lane = lanes.allocate(row, prow, undefined);
      addEdge(row, prow, lane, threadColors.get(nodes[parents[k]].thread)!);
    }
  }

  const rowOf = new Map<string, number>();
  rows.forEach((r, i) => {
    rowOf.set(r.node.id, i);
    if (r.node.kind === 'collapsed') {
      for (const c of r.node.commits) {
        rowOf.set(c.id, i);
      }
    }
  });

  return {
    rows,
    laneCount: lanes.count,
    rowOf,
    threadColors,
    threadLanes,
    hiddenCount
  };
}

/**
 * Find and collapse the linear runs; fills `redirect` (hidden id -> collapsed
 * node id), `out` and `outOrder` (input position of the run's newest hidden
 * commit). Returns the number of hidden commits.
 */
function collapseRuns<T extends IGraphCommit>(
  list: T[],
  byId: Map<string, number>,
  options: ICollapseOptions,
  pinned: Set<string>,
  redirect: Map<string, string>,
  out: ICollapsedNode<T>[],
  outOrder: number[]
): number {
  const n = list.length;
  const childCount = new Int32Array(n);
  const onlyChild = new Int32Array(n).fill(-1);
  for (let i = 0; i < n; i++) {
    const seen = new Set<string>();
    for (const p of list[i].parents) {
      const pi = byId.get(p);
      if (pi !== undefined && !seen.has(p)) {
        seen.add(p);
        childCount[pi]++;
        onlyChild[pi] = i;
      }
    }
  }
  const collapsible = new Uint8Array(n);
  for (let i = 0; i < n; i++) {
    const c = list[i];
    if (c.parents.length !== 1 || pinned.has(c.id) || childCount[i] !== 1) {
      continue;
    }
    const pi = byId.get(c.parents[0]);
    if (pi === undefined || list[pi].thread !== c.thread) {
      continue;
    }
    const child = list[onlyChild[i]];
    if (child.thread !== c.thread || child.parents[0] !== c.id) {
      continue;
    }
    collapsible[i] = 1;
  }
  const keep = Math.max(0, options.keepRecent ?? 3);
  const expanded = options.expanded;
  let hidden = 0;
  for (let i = 0; i < n; i++) {
    if (!collapsible[i] || collapsible[onlyChild[i]]) {
      continue; // not the top of a run
    }
    const run: number[] = [];
    let cur = i;
    const guard = new Set<number>();
    while (cur !== undefined && collapsible[cur] && !guard.has(cur)) {
      guard.add(cur);
      run.push(cur);
      cur = byId.get(list[cur].parents[0])!;
    }
    if (run.length < options.minRun || run.length - keep < 2) {
      continue;
    }
    const hiddenIdx = run.slice(keep);
    const key = list[hiddenIdx[hiddenIdx.length - 1]].id;
    if (expanded && expanded.has(key)) {
      continue;
    }
    const id = COLLAPSED_PREFIX + key;
    const hiddenCommits = hiddenIdx.map(k => list[k]);
    for (const c of hiddenCommits) {
      redirect.set(c.id, id);
    }
    out.push({
      kind: 'collapsed',
      id,
      key,
      thread: list[i].thread,
      created: hiddenCommits[0].created,
      commits: hiddenCommits,
      parents: [],
      dangling: false
    });
    outOrder.push(hiddenIdx[0]);
    hidden += hiddenCommits.length;
  }
  return hidden;
}

/**
 * Order nodes so that every node comes before its parents, newest first
 * (ties: input order). Kahn's algorithm with a max-heap; nodes on a cycle
 * (malformed input) are appended at the end, newest first.
 */
function topoOrder<T extends IGraphCommit>(
  nodes: GraphNode<T>[],
  order: number[],
  parentIdx: number[][]
): number[] {
  const m = nodes.length;
  const pendingChildren = new Int32Array(m);
  for (let i = 0; i < m; i++) {
    for (const p of parentIdx[i]) {
      pendingChildren[p]++;
    }
  }
  // a before b when a is newer, or as new and earlier in the input.
  const before = (a: number, b: number) => {
    const d = nodes[a].created - nodes[b].created;
    return d !== 0 ? d > 0 : order[a] < order[b];
  };
  const heap = new Heap(before);
  for (let i = 0; i < m; i++) {
    if (pendingChildren[i] === 0) {
      heap.push(i);
    }
  }
  const out: number[] = [];
  const done = new Uint8Array(m);
  while (heap.size > 0) {
    const i = heap.pop();
    out.push(i);
    done[i] = 1;
    for (const p of parentIdx[i]) {
      if (--pendingChildren[p] === 0) {
        heap.push(p);
      }
    }
  }
  if (out.length < m) {
    const rest: number[] = [];
    for (let i = 0; i < m; i++) {
      if (!done[i]) {
        rest.push(i);
      }
    }
    rest.sort((a, b) => (before(a, b) ? -1 : before(b, a) ? 1 : 0));
    out.push(...rest);
  }
  return out;
}

/** A binary heap of ints ordered by `before`. */
class Heap {
  constructor(private readonly before: (a: number, b: number) => boolean) {}

  get size(): number {
    return this._items.length;
  }

  push(x: number): void {
    const items = this._items;
    items.push(x);
    let i = items.length - 1;
    while (i > 0) {
      const parent = (i - 1) >> 1;
      if (!this.before(items[i], items[parent])) {
        break;
      }
      [items[i], items[parent]] = [items[parent], items[i]];
      i = parent;
    }
  }

  pop(): number {
    const items = this._items;
    const top = items[0];
    const last = items.pop()!;
    if (items.length > 0) {
      items[0] = last;
      let i = 0;
      for (;;) {
        const l = 2 * i + 1;
        const r = l + 1;
        let best = i;
        if (l < items.length && this.before(items[l], items[best])) {
          best = l;
        }
        if (r < items.length && this.before(items[r], items[best])) {
          best = r;
        }
        if (best === i) {
          break;
        }
        [items[i], items[best]] = [items[best], items[i]];
        i = best;
      }
    }
    return top;
  }

  private _items: number[] = [];
}

/** Lanes as lists of occupied (inclusive) row intervals. */
class LaneAllocator {
  get count(): number {
    return this._lanes.length;
  }

  /** Take a lane free over [from, to]: `preferred` if free, else the lowest. */
  allocate(from: number, to: number, preferred: number | undefined): number {
    let lane = -1;
    if (preferred !== undefined && this._free(preferred, from, to)) {
      lane = preferred;
    } else {
      for (let l = 0; l < this._lanes.length; l++) {
        if (this._free(l, from, to)) {
          lane = l;
          break;
        }
      }
    }
    if (lane === -1) {
      lane = this._lanes.length;
    }
    while (this._lanes.length <= lane) {
      this._lanes.push([]);
    }
    this._lanes[lane].push(from, to);
    return lane;
  }

  private _free(lane: number, from: number, to: number): boolean {
    const spans = this._lanes[lane];
    if (!spans) {
      return true;
    }
    for (let k = 0; k < spans.length; k += 2) {
      if (spans[k] <= to && from <= spans[k + 1]) {
        return false;
      }
    }
    return true;
  }

  private _lanes: number[][] = [];
}

/** All commits a node stands for (one, or the hidden run). */
export function nodeCommits<T extends IGraphCommit>(node: GraphNode<T>): T[] {
  return node.kind === 'commit' ? [node.commit] : node.commits;
}
