/**
 * Hibernate and wake from the UI: the "Hibernate Kernel" command and a click
 * on the "Hibernated" indicator. Failures (409 kernel_busy, a wake that did not
 * happen) become an error notification with the server's message and reason;
 * a notebook whose kernel cannot be hibernated says why.
 *
 * The notifier is injected (JupyterLab's Notification in the app, a fake in
 * tests).
 *
 * Also the panel's deletes and sizes (`SpaceActions`, below).
 */

import { asRequestError } from './errors';
import { formatBytes } from './format';
import { failureText, INotifier } from './progress';
import { RestStates } from './restState';
import type {
  ICommit,
  IDeleteRequest,
  IDeleteResult,
  ISpaceAPI,
  ISpaceStats
} from './types';

/** What the actions need to know of a notebook. */
export interface IRestTarget {
  /** The notebook's name, for messages. */
  name: string;
  kernel: { id: string; name: string } | null;
  /** Whether Infinijup manages the kernel. */
  managed: boolean;
}

export class RestActions {
  constructor(
    private readonly _states: RestStates,
    private readonly _notifier: INotifier
  ) {}

  /** Whether the Hibernate command can run on this notebook now. */
  canHibernate(target: IRestTarget | null): boolean {
    if (!target?.kernel || !target.managed) {
      return false;
    }
    const state = this._states.get(target.kernel.id).state;
    return state === 'running' || state === 'released';
  }

  /** Hibernate the notebook's kernel; true when it hibernated. */
  async hibernate(target: IRestTarget | null): Promise<boolean> {
    if (!target) {
      this._notifier.emit('Hibernate: open a notebook first.', 'warning', {
        autoClose: 5000
      });
      return false;
    }
    if (!target.kernel) {
      this._notifier.emit(
        `Cannot hibernate (${target.name}): it has no kernel running.`,
        'warning',
        { autoClose: 5000 }
      );
      return false;
    }
    if (!target.managed) {
      this._notifier.emit(
        `Cannot hibernate (${target.name}): its kernel is not managed by Infinijup. Switch to Python 3 (Infinijup) (Kernel › Change Kernel…).`,
        'warning',
        { autoClose: 8000 }
      );
      return false;
    }
    const state = this._states.get(target.kernel.id).state;
    if (state === 'hibernated' || state === 'hibernating') {
      return state === 'hibernated';
    }
    try {
      await this._states.hibernate(target.kernel.id);
      return true;
    } catch (error) {
      this._fail(`Hibernate of ${target.name}`, error);
      return false;
    }
  }

  /** Wake a resting kernel; true when it is awake. */
  async wake(name: string, kernelId: string): Promise<boolean> {
    try {
      const info = await this._states.wake(kernelId);
      return info.state === 'running';
    } catch (error) {
      this._fail(`Wake of ${name}`, error);
      return false;
    }
  }

  private _fail(label: string, error: unknown): void {
    const err = asRequestError(error);
    this._notifier.emit(
      failureText(label, err.message || 'failed', err.reason),
      'error',
      {
        autoClose: false,
        details: {
          title: `${label} failed`,
          message: err.message,
          reason: err.reason
        }
      }
    );
  }
}

/* ---------------------------------------------------------------------------
 * Getting space back (docs/space.md): delete a snapshot or a thread from the
 * history panel, after a confirmation that says what goes; the store's and
 * the hot tier's sizes for the panel's header.
 * ------------------------------------------------------------------------- */

/** Asks the person; true to go on. */
export type Confirm = (
  title: string,
  body: string,
  accept: string
) => Promise<boolean>;

/** "Store 42.9 MiB · hot copies 2.51 GiB" (without the hot part when unknown); the
 * UI says sizes in binary units throughout (format.ts formatBytes). */
export function spaceLine(stats: ISpaceStats | null): string {
  if (!stats || typeof stats.store_bytes !== 'number') {
    return '';
  }
  const hot =
    typeof stats.hot_bytes === 'number'
      ? ` · hot copies ${formatBytes(stats.hot_bytes)}`
      : '';
  return `Store ${formatBytes(stats.store_bytes)}${hot}`;
}

/** The history the questions are asked about. */
export interface IHistoryView {
  commits: readonly ICommit[];
  threads: { [name: string]: string };
}

/** Every commit reachable from `tips` (following parents). */
function reach(view: IHistoryView, tips: string[]): Set<string> {
  const byId = new Map(view.commits.map(c => [c.id, c]));
  const seen = new Set<string>();
  const stack = [...tips];
  while (stack.length) {
    const id = stack.pop()!;
    if (seen.has(id)) {
      continue;
    }
    seen.add(id);
    for (const p of byId.get(id)?.parents ?? []) {
      stack.push(p);
    }
  }
  return seen;
}

/** The snapshots that would go with thread `name` (no other thread reaches them). */
export function onlyOnThread(view: IHistoryView, name: string): string[] {
  const tip = view.threads[name];
  if (!tip) {
    return [];
  }
  const others = reach(
    view,
    Object.entries(view.threads)
      .filter(([n]) => n !== name)
      .map(([, t]) => t)
  );
  return [...reach(view, [tip])].filter(id => !others.has(id));
}

/**
 * What deleting `commitId` would do, or why the panel already knows it cannot:
 * `children` (later snapshots that build on it), `moves` (thread -> new tip,
 * null: the thread goes).
 */
export function snapshotDeletion(
  view: IHistoryView,
  commitId: string
): { children: string[]; moves: { [thread: string]: string | null } } {
  const commit = view.commits.find(c => c.id === commitId);
  const children = view.commits
    .filter(c => c.parents.includes(commitId))
    .map(c => c.id);
  const parent = commit?.parents[0] ?? null;
  const moves: { [thread: string]: string | null } = {};
  for (const [name, tip] of Object.entries(view.threads)) {
    if (tip === commitId) {
      moves[name] = parent;
    }
  }
  return { children, moves };
}

/** The question before deleting a snapshot (null: it has children, say so instead). */
export function deleteSnapshotQuestion(
  view: IHistoryView,
  commitId: string
): string | null {
  const { children, moves } = snapshotDeletion(view, commitId);
  if (children.length) {
    return null;
  }
  const lines = [`Delete snapshot ${commitId.slice(0, 8)}?`];
  for (const [name, tip] of Object.entries(moves)) {
    lines.push(
      tip
        ? `Thread ${name} moves back to ${tip.slice(0, 8)}.`
        : `Thread ${name} has nothing left and is removed.`
    );
  }
  lines.push(
    'Its space is freed (what it shares with other snapshots stays). This cannot be undone.'
  );
  return lines.join('\n');
}

/** The question before deleting a thread. */
export function deleteThreadQuestion(view: IHistoryView, name: string): string {
  const gone = onlyOnThread(view, name);
  const what = gone.length
    ? `${gone.length} snapshot${gone.length === 1 ? '' : 's'} only this thread has ${
        gone.length === 1 ? 'goes' : 'go'
      } with it`
    : 'no snapshot goes with it (other threads reach them all)';
  return `Delete thread ${name}? ${what}. This cannot be undone.`;
}

/** Who the deletion is for. */
export interface ISpaceTarget {
  /** The notebook's session path. */
  path: string;
  kernelId: string | null;
}

export class SpaceActions {
  constructor(
    private readonly _api: ISpaceAPI,
    private readonly _notifier: INotifier,
    private readonly _confirm: Confirm
  ) {}

  /** The sizes, or null when the server could not say. */
  async stats(): Promise<ISpaceStats | null> {
    try {
      return await this._api.spaceStats();
    } catch {
      return null;
    }
  }

  /** Ask, then delete a snapshot; the result, or null (declined, refused, failed). */
  async deleteSnapshot(
    target: ISpaceTarget,
    view: IHistoryView,
    commitId: string
  ): Promise<IDeleteResult | null> {
    const short = commitId.slice(0, 8);
    const question = deleteSnapshotQuestion(view, commitId);
    if (question === null) {
      const n = snapshotDeletion(view, commitId).children.length;
      this._notifier.emit(
        `Cannot delete snapshot ${short}: ${n} later snapshot${n === 1 ? '' : 's'} build on it. Delete those first (from the newest), or delete the thread.`,
        'warning',
        { autoClose: 8000 }
      );
      return null;
    }
    if (!(await this._confirm('Delete snapshot', question, 'Delete'))) {
      return null;
    }
    return this._delete(`Delete of snapshot ${short}`, {
      ...this._who(target),
      commit: commitId
    });
  }

  /** Ask, then delete a thread. */
  async deleteThread(
    target: ISpaceTarget,
    view: IHistoryView,
    name: string
  ): Promise<IDeleteResult | null> {
    if (
      !(await this._confirm(
        'Delete thread',
        deleteThreadQuestion(view, name),
        'Delete'
      ))
    ) {
      return null;
    }
    return this._delete(`Delete of thread ${name}`, {
      ...this._who(target),
      thread: name
    });
  }

  private _who(target: ISpaceTarget): IDeleteRequest {
    return target.kernelId
      ? { kernel_id: target.kernelId }
      : { path: target.path };
  }

  private async _delete(
    label: string,
    body: IDeleteRequest
  ): Promise<IDeleteResult | null> {
    try {
      const result = await this._api.deleteFromHistory(body);
      const hot = result.hot_dropped
        ? ` and ${formatBytes(result.hot_freed_bytes)} of hot copies`
        : '';
      this._notifier.emit(
        `${label}: ${formatBytes(result.freed_bytes)} freed${hot}.`,
        'success',
        { autoClose: 5000 }
      );
      return result;
    } catch (error) {
      const err = asRequestError(error);
      this._notifier.emit(
        failureText(label, err.message || 'failed', err.reason),
        err.status === 409 ? 'warning' : 'error',
        {
          autoClose: false,
          details: {
            title: `${label} failed`,
            message: err.message,
            reason: err.reason
          }
        }
      );
      return null;
    }
  }
}
