/**
 * The per-cell timeline of a notebook (issue 30): the snapshots on the
 * kernel's path, one row per cell that made one, newest first.
 *
 * Pure functions, no DOM: the history panel's "Cells" view draws the result.
 *
 * - The path: from the tip of the thread the kernel stands on (HEAD's commit's
 *   thread, when that tip descends from HEAD) down through first parents to
 *   the root. Rows above HEAD are "ahead": cells undone, Redo goes there.
 * - Between two rows whose execution counts are not consecutive, a gap says
 *   which cells made no snapshot (too quick, or they changed nothing).
 * - Runs of automatic snapshots fold into one row ("cells [3]-[40]: 30
 *   automatic snapshots"), except the newest few and the rows that are pinned
 *   (HEAD, manual snapshots, thread tips, search matches); the user unfolds a
 *   run by its key.
 * - A search shows only the rows that match it, unfolded.
 */

import { cellInfo, changedVariables, executionCount } from './commits';
import type { ICommit, IHead } from './types';

/** One cell that made a snapshot. */
export interface ITimelineCell {
  kind: 'cell';
  commit: ICommit;
  /** The cell's execution count, when recorded. */
  count: number | null;
  /** The first line of the cell's source ('' when not recorded). */
  source: string;
  /** Taken automatically (not asked for). */
  auto: boolean;
  /** Thinned with age: in the history, not restorable. */
  thinned: boolean;
  /** The kernel stands on it. */
  head: boolean;
  /** Newer than HEAD on HEAD's thread: undone, Redo goes back there. */
  ahead: boolean;
  /** Variables the cell changed (or made). */
  changed: string[];
  /**
   * Cells between this one and the row below that made no snapshot
   * ([first, last] execution counts), or null.
   */
  skipped: [number, number] | null;
}

/** A folded run of automatic snapshots. */
export interface ITimelineFold {
  kind: 'fold';
  /** Stable key of the run: the id of its oldest commit. */
  key: string;
  /** The folded cells, newest first. */
  cells: ITimelineCell[];
}

export type TimelineEntry = ITimelineCell | ITimelineFold;

export interface ITimelineOptions {
  /** Commits shown on their own whatever they are (thread tips...). */
  pinned?: ReadonlySet<string>;
  /** Keys of runs the user unfolded. */
  expanded?: ReadonlySet<string>;
  /** The search: only matching commits are shown (and nothing folds). */
  matches?: ((id: string) => boolean) | null;
  /** Fold runs of at least this many automatic snapshots (default 6). */
  minFold?: number;
  /** Keep the newest this many rows of the path unfolded (default 3). */
  keepRecent?: number;
}

/**
 * The commits of the kernel's path, newest first: from the tip of HEAD's
 * thread (or HEAD itself, or without a head the newest commit) through first
 * parents. Stops at a parent that is not loaded.
 */
export function cellPath(
  commits: readonly ICommit[],
  head: IHead | null,
  threads: { readonly [name: string]: string }
): { path: ICommit[]; headIndex: number } {
  const byId = new Map<string, ICommit>();
  for (const c of commits) {
    if (!byId.has(c.id)) {
      byId.set(c.id, c);
    }
  }
  const headCommit = head?.commit ? byId.get(head.commit) : undefined;
  let start: ICommit | undefined = headCommit ?? commits[0];
  if (headCommit) {
    const tip = byId.get(threads[headCommit.thread] ?? '');
    if (tip && tip.id !== headCommit.id) {
      // The tip is ahead of HEAD only if HEAD is on its first-parent line.
      for (const c of walk(tip, byId)) {
        if (c.id === headCommit.id) {
          start = tip;
          break;
        }
      }
    }
  }
  const path = start ? [...walk(start, byId)] : [];
  const headIndex = headCommit
    ? path.findIndex(c => c.id === headCommit.id)
    : -1;
  return { path, headIndex };
}

function* walk(start: ICommit, byId: Map<string, ICommit>): Generator<ICommit> {
  const seen = new Set<string>();
  let c: ICommit | undefined = start;
  while (c && !seen.has(c.id)) {
    seen.add(c.id);
    yield c;
    c = c.parents.length ? byId.get(c.parents[0]) : undefined;
  }
}

/** The timeline's rows, newest first. */
export function cellTimeline(
  commits: readonly ICommit[],
  head: IHead | null,
  threads: { readonly [name: string]: string },
  options: ITimelineOptions = {}
): TimelineEntry[] {
  const { path, headIndex } = cellPath(commits, head, threads);
  const cells: ITimelineCell[] = path.map((commit, i) => {
    const cell = cellInfo(commit);
    const count = executionCount(commit);
    const below = path[i + 1];
    const belowCount = below ? executionCount(below) : null;
    return {
      kind: 'cell',
      commit,
      count,
      source: cell?.source ?? '',
      auto: commit.metadata?.auto === true,
      thinned: commit.thinned === true,
      head: i === headIndex,
      ahead: headIndex > 0 && i < headIndex,
      changed: (changedVariables(commit) ?? []).map(v => v.name),
      skipped:
        count !== null && belowCount !== null && count - belowCount > 1
          ? [belowCount + 1, count - 1]
          : null
    };
  });

  const matches = options.matches ?? null;
  if (matches) {
    return cells.filter(c => matches(c.commit.id));
  }

  const minFold = Math.max(2, options.minFold ?? 6);
  const keepRecent = Math.max(0, options.keepRecent ?? 3);
  const pinned = options.pinned ?? new Set<string>();
  const expanded = options.expanded ?? new Set<string>();
  const foldable = (c: ITimelineCell, i: number) =>
    i >= keepRecent &&
    c.auto &&
    !c.head &&
    !c.ahead &&
    !pinned.has(c.commit.id);

  const out: TimelineEntry[] = [];
  let run: ITimelineCell[] = [];
  const flush = () => {
    const key = run.length ? run[run.length - 1].commit.id : '';
    if (run.length >= minFold && !expanded.has(key)) {
      out.push({ kind: 'fold', key, cells: run });
    } else {
      out.push(...run);
    }
    run = [];
  };
  cells.forEach((c, i) => {
    if (foldable(c, i)) {
      run.push(c);
    } else {
      flush();
      out.push(c);
    }
  });
  flush();
  return out;
}

/** "[12]", or "[ ]" when the count is unknown. */
export function countLabel(count: number | null): string {
  return count === null ? '[ ]' : `[${count}]`;
}

/** "cells [13]-[15] made no snapshot" for a gap, "cell [13] ..." for one. */
export function skippedText([first, last]: [number, number]): string {
  const n = last - first + 1;
  const which =
    n === 1 ? `cell [${first}]` : `${n} cells, [${first}]-[${last}],`;
  return `${which} made no snapshot (too quick, or changed nothing)`;
}

/** "cells [3]-[40]: 30 automatic snapshots" for a fold. */
export function foldText(fold: ITimelineFold): string {
  const newest = fold.cells[0].count;
  const oldest = fold.cells[fold.cells.length - 1].count;
  const span =
    newest !== null && oldest !== null ? `cells [${oldest}]-[${newest}]: ` : '';
  return `${span}${fold.cells.length} automatic snapshots`;
}
