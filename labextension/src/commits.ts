/**
 * What a commit says about itself, and what two commits say about each other
 * (pure, no JupyterLab imports): labels from the last executed cell, the
 * variables it changed, search, comparison, and where the next snapshot goes.
 *
 * Every reader tolerates commits without `metadata.cell` or
 * `metadata.variables` (snapshots taken before the kernel recorded them) and
 * malformed values: they read as "not recorded", never as an error.
 */

import type {
  ICellInfo,
  ICommit,
  IHead,
  IVariableInfo,
  IVariables
} from './types';

/** The default thread, as on the server (infinijup/engine/naming.py). */
export const DEFAULT_THREAD = 'main';

/** `metadata.cell`, or null when absent or malformed. */
export function cellInfo(commit: ICommit): ICellInfo | null {
  const cell = commit.metadata?.cell;
  if (!cell || typeof cell !== 'object') {
    return null;
  }
  const count = cell.execution_count;
  return {
    execution_count:
      typeof count === 'number' && Number.isFinite(count) ? count : null,
    source: typeof cell.source === 'string' ? firstLine(cell.source) : ''
  };
}

/** The execution count the snapshot was taken after, if known. */
export function executionCount(commit: ICommit): number | null {
  const cell = cellInfo(commit);
  if (cell && cell.execution_count !== null) {
    return cell.execution_count;
  }
  const count = commit.metadata?.execution_count;
  return typeof count === 'number' && Number.isFinite(count) ? count : null;
}

/**
 * The commit's label: its message, else "[N] <first line of the last cell>",
 * else "after cell [N]", else "(no message)".
 */
export function commitTitle(commit: ICommit): string {
  if (commit.message) {
    return firstLine(commit.message) || commit.message;
  }
  return cellLabel(commit) ?? '(no message)';
}

/** "[N] <first line>" of the last executed cell, or null when unknown. */
export function cellLabel(commit: ICommit): string | null {
  const cell = cellInfo(commit);
  const count = executionCount(commit);
  const n = count === null ? '[ ]' : `[${count}]`;
  if (cell && cell.source) {
    return `${n} ${cell.source}`;
  }
  return count === null ? null : `after cell ${n}`;
}

/** Whether the label comes from a message (not derived). */
export function hasMessage(commit: ICommit): boolean {
  return !!commit.message;
}

/** `metadata.variables`, normalized, or null when not recorded. */
export function variablesOf(commit: ICommit): IVariables | null {
  const vars = commit.metadata?.variables;
  if (!vars || typeof vars !== 'object' || !Array.isArray(vars.items)) {
    return null;
  }
  const items: IVariableInfo[] = [];
  for (const v of vars.items) {
    if (!v || typeof v !== 'object' || typeof v.name !== 'string') {
      continue;
    }
    items.push({
      name: v.name,
      type: typeof v.type === 'string' ? v.type : '?',
      size:
        typeof v.size === 'number' && Number.isFinite(v.size)
          ? Math.max(0, v.size)
          : 0,
      shape: typeof v.shape === 'string' && v.shape ? v.shape : null,
      fp: typeof v.fp === 'string' ? v.fp : String(v.fp ?? ''),
      changed: v.changed === true,
      ...(typeof v.value === 'string' && v.value ? { value: v.value } : {}),
      ...(v.partial === true ? { partial: true } : {})
    });
  }
  return { items, truncated: vars.truncated === true };
}

/** One of `metadata.sidecars`: a process the notebook started with `%sidecar`. */
export interface ISidecarInfo {
  name: string;
  argv: string[];
  running: boolean;
}

/** `metadata.sidecars`, normalized (empty when none were recorded). */
export function sidecarsOf(commit: ICommit): ISidecarInfo[] {
  const items = commit.metadata?.sidecars;
  if (!Array.isArray(items)) {
    return [];
  }
  const out: ISidecarInfo[] = [];
  for (const s of items) {
    if (!s || typeof s !== 'object' || typeof s.name !== 'string') {
      continue;
    }
    out.push({
      name: s.name,
      argv: Array.isArray(s.argv)
        ? s.argv.filter((a: unknown) => typeof a === 'string')
        : [],
      running: s.running === true
    });
  }
  return out;
}

/** The variables that changed since the parent (new ones included). */
export function changedVariables(commit: ICommit): IVariableInfo[] | null {
  const vars = variablesOf(commit);
  return vars ? vars.items.filter(v => v.changed) : null;
}

/**
 * Names the parent had and this commit no longer has (deleted variables);
 * empty when either list is missing or truncated (then nothing is known).
 */
export function removedVariables(
  commit: ICommit,
  parent: ICommit | undefined
): string[] {
  const mine = commit && variablesOf(commit);
  const theirs = parent && variablesOf(parent);
  if (!mine || !theirs || mine.truncated || theirs.truncated) {
    return [];
  }
  const names = new Set(mine.items.map(v => v.name));
  return theirs.items
    .map(v => v.name)
    .filter(name => !names.has(name))
    .sort();
}

/**
 * Whether a commit matches a search: every word of the query is found in its
 * message, its cell label, its id (prefix), its thread, or the name of a
 * variable it changed (case-insensitive). `var:NAME` words match variable
 * names only (changed or not).
 */
export function matchesQuery(commit: ICommit, query: string): boolean {
  const words = query.trim().toLowerCase().split(/\s+/).filter(Boolean);
  if (words.length === 0) {
    return true;
  }
  const vars = variablesOf(commit)?.items ?? [];
  const changed = vars.filter(v => v.changed).map(v => v.name.toLowerCase());
  const all = vars.map(v => v.name.toLowerCase());
  const text = [commit.message, cellLabel(commit) ?? '', commit.thread]
    .join('\n')
    .toLowerCase();
  return words.every(word => {
    if (word.startsWith('var:')) {
      const name = word.slice(4);
      return !!name && all.some(n => n.includes(name));
    }
    return (
      text.includes(word) ||
      commit.id.startsWith(word) ||
      changed.some(n => n.includes(word))
    );
  });
}

/** A variable that differs between two commits. */
export interface IVariableDiff {
  name: string;
  /** In commit A (null: absent there). */
  a: IVariableInfo | null;
  /** In commit B (null: absent there). */
  b: IVariableInfo | null;
  kind: 'only-a' | 'only-b' | 'changed';
}

/** Which variables differ between two commits. */
export interface ICommitComparison {
  /** False when either commit has no variable list (older snapshots). */
  available: boolean;
  /** Differences, by name. */
  diffs: IVariableDiff[];
  /** Names present in both with the same fingerprint. */
  same: string[];
  /** Either list was truncated: variables beyond it were not compared. */
  partial: boolean;
}

/**
 * Compare the variables of two commits: present in one only, or present in
 * both with different fingerprints (or types).
 */
export function compareCommits(a: ICommit, b: ICommit): ICommitComparison {
  const va = variablesOf(a);
  const vb = variablesOf(b);
  if (!va || !vb) {
    return { available: false, diffs: [], same: [], partial: false };
  }
  const mapA = new Map(va.items.map(v => [v.name, v]));
  const mapB = new Map(vb.items.map(v => [v.name, v]));
  const names = [...new Set([...mapA.keys(), ...mapB.keys()])].sort();
  const diffs: IVariableDiff[] = [];
  const same: string[] = [];
  const partial = va.truncated || vb.truncated;
  for (const name of names) {
    const x = mapA.get(name) ?? null;
    const y = mapB.get(name) ?? null;
    if (x && y) {
      if (x.fp !== y.fp || x.type !== y.type) {
        diffs.push({ name, a: x, b: y, kind: 'changed' });
      } else {
        same.push(name);
      }
    } else if (x) {
      // Beyond a truncated list, absence is not known.
      if (!vb.truncated) {
        diffs.push({ name, a: x, b: null, kind: 'only-a' });
      }
    } else if (y) {
      if (!va.truncated) {
        diffs.push({ name, a: null, b: y, kind: 'only-b' });
      }
    }
  }
  return { available: true, diffs, same, partial };
}

/** Where the next snapshot of a kernel goes. */
export interface INextSnapshot {
  /** The thread's name. */
  thread: string;
  /** True when that thread does not exist yet (it starts at HEAD). */
  isNew: boolean;
  /** The parent of the next snapshot (HEAD; null: a new root, from a fresh kernel). */
  parent: string | null;
}

/**
 * Where the next snapshot goes, as the server plans it
 * (infinijup/engine/heads.py plan_snapshot). The server's `next_thread` is
 * used when it sends one; the rules below are the fallback for older servers
 * and for the moment between a restore and the history reload.
 *
 * @param commitThread - the thread HEAD's commit was made on (the base of an
 *   auto-named new thread when `head.thread` is null).
 */
export function nextSnapshot(
  head: IHead | null,
  threads: { readonly [name: string]: string },
  commitThread?: string
): INextSnapshot {
  const commit = head?.commit ?? null;
  const planned = head?.next_thread;
  if (planned) {
    const tip = threads[planned];
    return {
      thread: planned,
      isNew: tip === undefined,
      parent: commit ?? tip ?? null
    };
  }
  const name = head ? head.thread : DEFAULT_THREAD;
  let base: string;
  if (name) {
    const tip = threads[name];
    if (tip === undefined || tip === commit) {
      return { thread: name, isNew: tip === undefined, parent: commit };
    }
    // A fresh kernel (commit null) starts a new root next to its thread.
    base = name;
  } else {
    base = commitThread || DEFAULT_THREAD;
  }
  return {
    thread: autoThreadName(base, new Set(Object.keys(threads))),
    isNew: true,
    parent: commit
  };
}

/** A new thread name next to `base`: main-1, main-2... (naming.py). */
export function autoThreadName(base: string, taken: Set<string>): string {
  const stem = base.replace(/-\d+$/, '') || DEFAULT_THREAD;
  let n = 1;
  while (taken.has(`${stem}-${n}`)) {
    n++;
  }
  return `${stem}-${n}`;
}

/**
 * Find a commit by full id, thread name or unique id prefix (4+ hex digits).
 * Returns the commit, or why not ('missing' or 'ambiguous').
 */
export function resolveRef(
  commits: readonly ICommit[],
  threads: { readonly [name: string]: string },
  ref: string
): ICommit | 'missing' | 'ambiguous' {
  ref = ref.trim();
  const exact = commits.find(c => c.id === ref);
  if (exact) {
    return exact;
  }
  const tip = threads[ref];
  if (tip) {
    return commits.find(c => c.id === tip) ?? 'missing';
  }
  if (/^[0-9a-f]{4,}$/i.test(ref)) {
    const lower = ref.toLowerCase();
    const found = commits.filter(c => c.id.startsWith(lower));
    if (found.length === 1) {
      return found[0];
    }
    return found.length > 1 ? 'ambiguous' : 'missing';
  }
  return 'missing';
}

function firstLine(text: string): string {
  for (const line of text.split('\n')) {
    const trimmed = line.trim();
    if (trimmed) {
      return trimmed;
    }
  }
  return '';
}
