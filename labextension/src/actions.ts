/**
 * The user-facing operations: snapshot, restore, branch, resume, copy id.
 * They say why when they cannot run (no kernel, a kernel Infinijup does not
 * manage, an unknown commit), check the commit before asking for
 * confirmation, track progress in a notification and refresh the history.
 */

import {
  Clipboard,
  Dialog,
  InputDialog,
  Notification,
  showDialog
} from '@jupyterlab/apputils';
import { PathExt } from '@jupyterlab/coreutils';
import type { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import type { Kernel } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import {
  commitTitle,
  INextSnapshot,
  nextSnapshot,
  resolveRef
} from './commits';
import {
  formatAge,
  formatBytes,
  formatSeconds,
  shortId,
  isValidThreadName
} from './format';
import { asRequestError } from './errors';
import type { ManagedKernels } from './kernels';
import type { HistoryModel } from './model';
import { CommitPicker } from './picker';
import type { ProgressTracker } from './progress';
import type {
  IBranchResult,
  ICommit,
  IHistory,
  IInfinijupAPI,
  IOperationEvent,
  IRestoreResult,
  IResumeResult,
  ISnapshotResult
} from './types';
import { KERNELSPEC_NAME } from './types';

/** The settings of the extension (labextension/schema/plugin.json). */
export interface IInfinijupSettings {
  askMessage: boolean;
  confirmRestore: boolean;
  collapseRuns: boolean;
  collapseMinRun: number;
  /** Kernels' automatic snapshots: the server's setting, or on, or off. */
  autosnapshot: 'server' | 'on' | 'off';
}

export const DEFAULT_SETTINGS: IInfinijupSettings = {
  askMessage: false,
  confirmRestore: true,
  collapseRuns: true,
  collapseMinRun: 10,
  autosnapshot: 'server'
};

/** The kernel a notebook must run to be snapshotted. */
const KERNEL_DISPLAY_NAME = 'Python 3 (Infinijup)';

export class InfinijupActions {
  constructor(options: InfinijupActions.IOptions) {
    this._api = options.api;
    this._tracker = options.tracker;
    this.managed = options.managed;
    this._progress = options.progress;
    this.model = options.model;
    this._getSettings = options.settings;
    this._setSetting = options.setSetting;
    this._openNotebook = options.openNotebook;
    this._changeKernel = options.changeKernel;
  }

  readonly managed: ManagedKernels;
  readonly model: HistoryModel;

  /** Emitted when an operation starts or ends on a kernel (or notebook path). */
  get busyChanged(): ISignal<this, string> {
    return this._busyChanged;
  }

  /** The notebook with this widget id, or the current one. */
  notebook(id?: unknown): NotebookPanel | null {
    if (typeof id === 'string' && id) {
      return this._tracker.find(p => p.id === id) ?? null;
    }
    return this._tracker.currentWidget;
  }

  /** The kernel of a notebook. */
  kernelOf(panel: NotebookPanel | null): Kernel.IKernelConnection | null {
    return panel?.sessionContext.session?.kernel ?? null;
  }

  /** Whether the notebook's kernel is managed by Infinijup. */
  isManaged(panel: NotebookPanel | null): boolean {
    const kernel = this.kernelOf(panel);
    return !!kernel && this.managed.isManaged(kernel);
  }

  /** Whether snapshots and restores can run on this notebook's kernel now. */
  canOperate(panel: NotebookPanel | null): boolean {
    const kernel = this.kernelOf(panel);
    return (
      !!kernel &&
      this.managed.isManaged(kernel) &&
      !this.isBusy(kernel.id) &&
      !this.isBusy(pathKey(panel))
    );
  }

  /** Whether a kernel can be resumed into this notebook now. */
  canResume(panel: NotebookPanel | null): boolean {
    return (
      !!panel &&
      !this.isBusy(pathKey(panel)) &&
      !this.isBusy(this.kernelOf(panel)?.id)
    );
  }

  /** Whether an operation runs on a kernel (started here or seen in events). */
  isBusy(kernelId: string | undefined): boolean {
    return (
      !!kernelId && (this._busy.has(kernelId) || this._remoteBusy.has(kernelId))
    );
  }

  /** Track operations started elsewhere. */
  handleEvent(event: IOperationEvent): void {
    const was = this.isBusy(event.kernel_id);
    if (event.phase === 'done' || event.phase === 'error') {
      this._remoteBusy.delete(event.kernel_id);
    } else {
      this._remoteBusy.add(event.kernel_id);
    }
    if (was !== this.isBusy(event.kernel_id)) {
      this._busyChanged.emit(event.kernel_id);
    }
  }

  /** Take a snapshot of a notebook's kernel. */
  async snapshot(
    panel: NotebookPanel | null,
    options: { message?: string } = {}
  ): Promise<ISnapshotResult | null> {
    const kernel = this._requireManaged(panel, 'snapshot');
    if (!panel || !kernel) {
      return null;
    }
    let message = options.message;
    if (message === undefined && this._getSettings().askMessage) {
      const result = await InputDialog.getText({
        title: 'Snapshot Kernel',
        label: `Message for the snapshot of ${name(panel)} (optional)`,
        placeholder: 'e.g. after loading the data',
        okLabel: 'Snapshot'
      });
      if (!result.button.accept) {
        return null;
      }
      message = (result.value ?? '').trim();
    }
    const handle = this._progress.begin(
      'snapshot',
      kernel.id,
      `Snapshot of ${name(panel)}`
    );
    this._setBusy(kernel.id, true);
    try {
      const result = await this._api.snapshot({
        kernel_id: kernel.id,
        message: message || undefined
      });
      handle.succeed(
        `Snapshot ${shortId(result.commit)} saved on ${result.thread}: ` +
          `${formatBytes(result.stats.stored_bytes)} stored, kernel paused ` +
          `${formatSeconds(result.stats.pause_s)}`
      );
      this._refreshIfShown(panel);
      return result;
    } catch (error) {
      handle.fail(error);
      return null;
    } finally {
      this._setBusy(kernel.id, false);
    }
  }

  /**
   * Restore a notebook's kernel to a commit (asking which when `ref` is not
   * given), optionally starting a new thread there. Without a kernel, or with
   * a kernel Infinijup does not manage, the commit is resumed into a new
   * kernel instead (`resume`).
   */
  async restore(
    panel: NotebookPanel | null,
    ref?: string,
    options: { branch?: string } = {}
  ): Promise<IRestoreResult | IResumeResult | null> {
    if (panel && !options.branch && !this.isManaged(panel)) {
      return this.resume(panel, ref);
    }
    const op = options.branch ? 'branch from a snapshot' : 'restore a snapshot';
    const kernel = this._requireManaged(panel, op);
    if (!panel || !kernel) {
      return null;
    }
    const history = await this._loadHistory(panel);
    if (!ref) {
      ref =
        (await this.pickCommit(panel, 'Restore Kernel Snapshot', history)) ??
        undefined;
      if (!ref) {
        return null;
      }
    }
    // Check first, then confirm.
    const commit = this._check(panel, ref, history);
    if (commit === null) {
      return null;
    }
    const label = describe(commit, ref);
    if (this._getSettings().confirmRestore) {
      const result = await showDialog({
        title: options.branch
          ? `Branch ${options.branch} from ${label}?`
          : `Restore ${label}?`,
        body:
          `The running kernel of ${name(panel)} will be replaced by the ` +
          `state saved in ${label}. What the kernel holds now is lost unless ` +
          'you take a snapshot first. The notebook stays open and connected.',
        buttons: [
          Dialog.cancelButton(),
          Dialog.warnButton({ label: options.branch ? 'Branch' : 'Restore' })
        ],
        checkbox: {
          label: 'Do not ask again',
          caption: 'Restore without confirmation (Settings › Infinijup)',
          checked: false
        }
      });
      if (!result.button.accept) {
        return null;
      }
      if (result.isChecked && this._setSetting) {
        void this._setSetting('confirmRestore', false);
      }
    }
    const target = commit?.id ?? ref;
    let force = false;
    let refusal = '';
    for (;;) {
      const handle = this._progress.begin(
        'restore',
        kernel.id,
        `${options.branch ? 'Branch' : 'Restore'} of ${name(panel)}`
      );
      this._setBusy(kernel.id, true);
      try {
        const result = await this._api.restore({
          kernel_id: kernel.id,
          commit: target,
          branch: options.branch,
          force: force || undefined
        });
        await resyncKernel(kernel);
        const next = await this._nextAfter(kernel.id, result.thread);
        handle.succeed(
          `Restored ${shortId(result.commit)}` +
            (options.branch ? ` into new thread ${options.branch}` : '') +
            ` in ${formatSeconds(result.duration_s)}` +
            (next && !options.branch ? ` · ${describeNext(next)}` : '')
        );
        this._refreshIfShown(panel);
        return result;
      } catch (error) {
        handle.fail(error);
        const err = asRequestError(error);
        if (force || err.reason !== 'gpu_mismatch') {
          return null;
        }
        refusal = err.message;
      } finally {
        this._setBusy(kernel.id, false);
      }
      // The snapshot was taken on other GPUs (model, count or driver): the
      // server refuses unless asked to force.
      const answer = await showDialog({
        title: 'The GPUs differ from the snapshot’s',
        body:
          `${refusal}\n\nThe snapshot holds GPU state from a different GPU model, ` +
          'GPU count or driver. Restoring anyway may fail, or CUDA may not work in ' +
          'the restored kernel.',
        buttons: [
          Dialog.cancelButton(),
          Dialog.warnButton({ label: 'Restore anyway' })
        ]
      });
      if (!answer.button.accept) {
        return null;
      }
      force = true;
    }
  }

  /**
   * Start a new thread at a commit (asking for the commit and the name).
   * At HEAD the kernel is left alone (nothing to restore, nothing lost);
   * elsewhere the commit is restored into the new thread.
   */
  async branch(
    panel: NotebookPanel | null,
    ref?: string,
    thread?: string
  ): Promise<IRestoreResult | IBranchResult | IResumeResult | null> {
    const kernel = this._requireManaged(panel, 'branch from a snapshot');
    if (!panel || !kernel) {
      return null;
    }
    const history = await this._loadHistory(panel);
    if (!ref) {
      ref =
        (await this.pickCommit(
          panel,
          'Branch from Kernel Snapshot',
          history
        )) ?? undefined;
      if (!ref) {
        return null;
      }
    }
    const commit = this._check(panel, ref, history);
    if (commit === null) {
      return null;
    }
    const threads = history?.threads ?? null;
    while (!thread) {
      const result = await InputDialog.getText({
        title: `Branch from ${describe(commit, ref)}`,
        label: 'Name of the new thread',
        placeholder: 'e.g. try-lower-lr',
        okLabel: 'Next'
      });
      if (!result.button.accept) {
        return null;
      }
      const value = (result.value ?? '').trim();
      if (!isValidThreadName(value)) {
        Notification.warning(
          `"${value}" is not a valid thread name: use letters, digits, ".", "_" or "-" (up to 64, starting with a letter or digit, no "--").`,
          { autoClose: 5000 }
        );
        continue;
      }
      if (threads && value in threads) {
        Notification.warning(`A thread named "${value}" already exists.`, {
          autoClose: 5000
        });
        continue;
      }
      thread = value;
    }
    const head = history?.head?.commit ?? null;
    if (commit && head === commit.id) {
      return this._branchAtHead(panel, kernel, commit, thread);
    }
    return this.restore(panel, commit?.id ?? ref, { branch: thread });
  }

  /**
   * Start a new kernel from a commit: into this notebook (`resume here`: when
   * it has no kernel, or replacing a kernel Infinijup does not manage) or
   * into a copy of the notebook (`newNotebook`). A notebook whose kernel is
   * managed restores in place instead.
   */
  async resume(
    panel: NotebookPanel | null,
    ref?: string,
    options: { newNotebook?: boolean } = {}
  ): Promise<IRestoreResult | IResumeResult | null> {
    if (!panel) {
      Notification.warning('Open a notebook to resume one of its snapshots.', {
        autoClose: 5000
      });
      return null;
    }
    const newNotebook = !!options.newNotebook;
    const kernel = this.kernelOf(panel);
    if (!newNotebook && this.isManaged(panel)) {
      return this.restore(panel, ref);
    }
    if (!this.canResume(panel)) {
      Notification.warning(
        `An operation is already running on ${name(panel)}.`,
        { autoClose: 5000 }
      );
      return null;
    }
    const history = await this._loadHistory(panel);
    if (!ref) {
      ref =
        (await this.pickCommit(
          panel,
          newNotebook ? 'Open Snapshot in a New Notebook' : 'Resume Snapshot',
          history
        )) ?? undefined;
      if (!ref) {
        return null;
      }
    }
    const commit = this._check(panel, ref, history);
    if (commit === null) {
      return null;
    }
    const label = describe(commit, ref);
    if (commit?.resumable === false) {
      Notification.error(
        `${label} cannot be resumed here: ${commit.resumable_reason || 'the server says no'}`,
        { autoClose: false }
      );
      return null;
    }
    if (!newNotebook && kernel) {
      // A kernel Infinijup does not manage: it is shut down and replaced.
      const result = await showDialog({
        title: `Replace the kernel with ${label}?`,
        body:
          `The kernel of ${name(panel)} (${panel.sessionContext.kernelDisplayName}) ` +
          `will be shut down and replaced by a new ${KERNEL_DISPLAY_NAME} kernel ` +
          `resumed from ${label}. What the kernel holds now is lost.`,
        buttons: [
          Dialog.cancelButton(),
          Dialog.warnButton({ label: 'Replace' })
        ]
      });
      if (!result.button.accept) {
        return null;
      }
    }
    // Just renamed: the session follows the file a moment later. The resume names the
    // notebook by its session's path (its history, the file a copy is made of), so the
    // session is moved to the file first (if that fails, the resume names it as before).
    await sessionAtFile(panel).catch(() => undefined);
    const busyKey = pathKey(panel);
    const handle = this._progress.begin(
      'resume',
      '',
      newNotebook
        ? `New notebook from ${name(panel)}`
        : `Resume of ${name(panel)}`,
      sessionPath(panel)
    );
    this._setBusy(busyKey, true);
    try {
      if (!newNotebook) {
        // One session per notebook: the notebook gets an Infinijup kernel
        // through its own session first (replacing the kernel the user agreed
        // to replace), and the server resumes into that kernel. A session the
        // server started would be a second one for this path, since Lab opens
        // its own under a temporary path and then renames it.
        const kernelName = commit?.metadata?.kernel_name;
        await panel.sessionContext.changeKernel({
          name:
            typeof kernelName === 'string' && kernelName
              ? kernelName
              : KERNELSPEC_NAME
        });
        // A notebook renamed while it had no session: Lab may have opened
        // this one under the old name.
        await sessionAtFile(panel);
      }
      const path = sessionPath(panel);
      const result = await this._api.resume({
        path,
        commit: commit?.id ?? ref,
        new_notebook: newNotebook || undefined,
        // the copy's one session is the one Lab makes when it opens it
        session: newNotebook ? false : undefined
      });
      const short = shortId(result.commit);
      if (newNotebook) {
        await this._openNotebook?.(result.path, result.kernel_id);
        handle.succeed(
          `Opened ${short} in ${PathExt.basename(result.path)}: a new kernel ` +
            `resumed in ${formatSeconds(result.duration_s)}`
        );
      } else {
        if (this.kernelOf(panel)?.id !== result.kernel_id) {
          await panel.sessionContext.changeKernel({ id: result.kernel_id });
        }
        const next = await this._nextAfter(result.kernel_id, result.thread);
        handle.succeed(
          `Resumed ${short} in a new kernel in ${formatSeconds(result.duration_s)}` +
            (next ? ` · ${describeNext(next)}` : '')
        );
        this._refreshIfShown(panel);
      }
      return result;
    } catch (error) {
      handle.fail(error);
      return null;
    } finally {
      this._setBusy(busyKey, false);
    }
  }

  /**
   * Ask for a commit: the notebook's commits (newest first, HEAD
   * preselected), or a typed id, id prefix or thread name.
   */
  async pickCommit(
    panel: NotebookPanel,
    title: string,
    history?: IHistory | null
  ): Promise<string | null> {
    if (history === undefined) {
      history = await this._loadHistory(panel);
    }
    const result = await showDialog({
      title,
      body: new CommitPicker({
        commits: history?.commits ?? [],
        head: history?.head?.commit ?? null
      }),
      buttons: [Dialog.cancelButton(), Dialog.okButton({ label: 'Next' })],
      focusNodeSelector: '.jp-Infinijup-picker-list'
    });
    if (!result.button.accept || !result.value) {
      return null;
    }
    return result.value;
  }

  /** Copy a commit id to the clipboard. */
  copyId(id: string): void {
    Clipboard.copyToSystem(id);
    Notification.info(`Copied ${shortId(id)}… to the clipboard`, {
      autoClose: 2000
    });
  }

  /**
   * The notebook's managed kernel, or null after saying why not (no
   * notebook, no kernel, a kernel Infinijup does not manage, busy).
   */
  private _requireManaged(
    panel: NotebookPanel | null,
    what: string
  ): Kernel.IKernelConnection | null {
    const kernel = this.kernelOf(panel);
    if (!panel) {
      Notification.warning(`Open a notebook to ${what}.`, { autoClose: 5000 });
      return null;
    }
    const changeKernel = this._changeKernel
      ? [
          {
            label: 'Change Kernel…',
            caption: `Choose ${KERNEL_DISPLAY_NAME}`,
            callback: () => this._changeKernel?.(panel)
          }
        ]
      : [];
    if (!kernel) {
      Notification.warning(
        `${name(panel)} has no kernel running. To ${what}, start ` +
          `${KERNEL_DISPLAY_NAME} (Kernel › Change Kernel…).`,
        { autoClose: 8000, actions: changeKernel }
      );
      return null;
    }
    if (!this.managed.isManaged(kernel)) {
      // JupyterLab cuts notifications at 140 characters: keep it short, the
      // action button says how.
      Notification.warning(
        `Cannot ${what} (${name(panel)}): its kernel ` +
          `(${panel.sessionContext.kernelDisplayName}) is not managed by ` +
          `Infinijup. Switch to ${KERNEL_DISPLAY_NAME}.`,
        { autoClose: 8000, actions: changeKernel }
      );
      return null;
    }
    if (this.isBusy(kernel.id) || this.isBusy(pathKey(panel))) {
      Notification.warning(
        `An operation is already running on the kernel of ${name(panel)}.`,
        { autoClose: 5000 }
      );
      return null;
    }
    return kernel;
  }

  /** The notebook's history: the panel's when it shows it, else loaded. */
  private async _loadHistory(panel: NotebookPanel): Promise<IHistory | null> {
    const kernel = this.kernelOf(panel);
    const target = this.model.target;
    if (
      target?.path === sessionPath(panel) &&
      (target.kernelId ?? null) === (kernel?.id ?? null) &&
      this.model.history
    ) {
      return this.model.history;
    }
    try {
      return await this._api.history(
        kernel ? { kernel_id: kernel.id } : { path: sessionPath(panel) }
      );
    } catch {
      return null; // the server checks the ref then
    }
  }

  /**
   * Resolve a ref against the history. Returns the commit; undefined when
   * the history could not be loaded (the server will check); null after
   * telling the user that the ref names no commit.
   */
  private _check(
    panel: NotebookPanel,
    ref: string,
    history: IHistory | null
  ): ICommit | undefined | null {
    if (!history) {
      return undefined;
    }
    const found = resolveRef(history.commits, history.threads, ref);
    if (found === 'missing') {
      Notification.error(
        `No snapshot “${ref}” in the history of ${name(panel)}: give a commit ` +
          'id, an id prefix (8+ hex digits) or a thread name.',
        { autoClose: 8000 }
      );
      return null;
    }
    if (found === 'ambiguous') {
      Notification.error(
        `“${ref}” matches several snapshots of ${name(panel)}: type more digits.`,
        { autoClose: 8000 }
      );
      return null;
    }
    return found;
  }

  /** A new thread at HEAD: the kernel keeps running untouched. */
  private async _branchAtHead(
    panel: NotebookPanel,
    kernel: Kernel.IKernelConnection,
    commit: ICommit,
    thread: string
  ): Promise<IBranchResult | null> {
    this._setBusy(kernel.id, true);
    try {
      const result = await this._api.branch({
        kernel_id: kernel.id,
        name: thread
      });
      Notification.success(
        `New thread ${result.thread} at ${shortId(commit.id)} (HEAD): the kernel ` +
          `was not touched; the next snapshot goes to ${result.thread}.`,
        { autoClose: 5000 }
      );
      this._refreshIfShown(panel);
      return result;
    } catch (error) {
      const err = asRequestError(error);
      Notification.error(
        `Branch of ${name(panel)} failed: ${err.message} (${err.reason})`,
        { autoClose: false }
      );
      return null;
    } finally {
      this._setBusy(kernel.id, false);
    }
  }

  /** Where the kernel's next snapshot goes now, as the server says. */
  private async _nextAfter(
    kernelId: string,
    thread: string | null
  ): Promise<INextSnapshot | null> {
    try {
      const history = await this._api.history({ kernel_id: kernelId });
      const headThread = history.commits.find(
        c => c.id === history.head?.commit
      )?.thread;
      return nextSnapshot(history.head, history.threads, headThread);
    } catch {
      return thread ? { thread, isNew: false, parent: null } : null;
    }
  }

  private _refreshIfShown(panel: NotebookPanel): void {
    if (this.model.target?.path === sessionPath(panel)) {
      void this.model.refresh();
    }
  }

  private _setBusy(key: string, busy: boolean): void {
    if (busy) {
      this._busy.add(key);
    } else {
      this._busy.delete(key);
    }
    this._busyChanged.emit(key);
  }

  private _api: IInfinijupAPI;
  private _tracker: INotebookTracker;
  private _progress: ProgressTracker;
  private _getSettings: () => IInfinijupSettings;
  private _setSetting?: (
    key: keyof IInfinijupSettings,
    value: any
  ) => Promise<void>;
  private _openNotebook?: (path: string, kernelId: string) => Promise<void>;
  private _changeKernel?: (panel: NotebookPanel) => void;
  private _busy = new Set<string>();
  private _remoteBusy = new Set<string>();
  private _busyChanged = new Signal<this, string>(this);
}

export namespace InfinijupActions {
  export interface IOptions {
    api: IInfinijupAPI;
    tracker: INotebookTracker;
    managed: ManagedKernels;
    progress: ProgressTracker;
    model: HistoryModel;
    settings: () => IInfinijupSettings;
    setSetting?: (key: keyof IInfinijupSettings, value: any) => Promise<void>;
    /** Open a notebook connected to a running kernel. */
    openNotebook?: (path: string, kernelId: string) => Promise<void>;
    /** Let the user choose the notebook's kernel. */
    changeKernel?: (panel: NotebookPanel) => void;
  }
}

/** "next snapshot on main" / "next snapshot starts new thread main-1". */
export function describeNext(next: INextSnapshot): string {
  return next.isNew
    ? `next snapshot starts new thread ${next.thread}`
    : `next snapshot on ${next.thread}`;
}

/** "1a2b3c4d · main · [3] df = load() · 5 min ago" */
export function commitLabel(commit: ICommit): string {
  return [
    shortId(commit.id),
    commit.thread,
    truncate(commitTitle(commit), 60),
    formatAge(commit.created)
  ].join(' · ');
}

function describe(commit: ICommit | undefined, ref: string): string {
  if (commit) {
    return `snapshot ${shortId(commit.id)} “${truncate(commitTitle(commit), 40)}”`;
  }
  return /^[0-9a-f]{8,}$/i.test(ref) ? `snapshot ${shortId(ref)}` : `“${ref}”`;
}

function truncate(text: string, n: number): string {
  return text.length > n ? text.slice(0, n - 1) + '…' : text;
}

/** The path the server knows the notebook's session by. */
export function sessionPath(panel: NotebookPanel): string {
  return panel.sessionContext.session?.path ?? panel.context.path;
}

/** Move the notebook's session, if any, to the notebook's file (its path on the server). */
async function sessionAtFile(panel: NotebookPanel): Promise<void> {
  const session = panel.sessionContext.session;
  const file = panel.context.localPath;
  if (session && file && session.path !== file) {
    await session.setPath(file);
  }
}

/** The busy key of a notebook without a kernel (a resume in progress). */
function pathKey(panel: NotebookPanel | null): string {
  return panel ? `path:${sessionPath(panel)}` : '';
}

function name(panel: NotebookPanel): string {
  return PathExt.basename(panel.context.path);
}

/**
 * After a restore the server has reconnected the kernel's channels to the
 * restored process; ask for kernel info so the status (and the kernel
 * indicator) is fresh, and reconnect the websocket if that gets no answer.
 */
export async function resyncKernel(
  kernel: Kernel.IKernelConnection,
  timeoutMs = 8000
): Promise<void> {
  const info = kernel.requestKernelInfo();
  let timer: ReturnType<typeof setTimeout> | undefined;
  const timeout = new Promise<'timeout'>(resolve => {
    timer = setTimeout(() => resolve('timeout'), timeoutMs);
  });
  try {
    const result = await Promise.race([info, timeout]);
    if (result === 'timeout') {
      console.warn(
        'Infinijup: no kernel_info reply after restore; reconnecting'
      );
      await kernel.reconnect();
    }
  } catch (error) {
    console.warn(
      'Infinijup: kernel_info after restore failed; reconnecting',
      error
    );
    await kernel.reconnect().catch(() => undefined);
  } finally {
    clearTimeout(timer);
  }
}
