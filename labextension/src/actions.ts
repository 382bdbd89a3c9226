/**
 * The user-facing operations: snapshot, restore, branch, copy id. They ask
 * for input (message, commit, thread name, confirmation) per the settings,
 * track progress in a notification and refresh the history.
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
  formatAge,
  formatBytes,
  formatSeconds,
  shortId,
  isValidThreadName
} from './format';
import { asRequestError } from './errors';
import type { ManagedKernels } from './kernels';
import type { HistoryModel } from './model';
import type { ProgressTracker } from './progress';
import type {
  ICommit,
  IHistory,
  IInfinijupAPI,
  IOperationEvent,
  IRestoreResult,
  ISnapshotResult
} from './types';

/** The settings of the extension (labextension/schema/plugin.json). */
export interface IInfinijupSettings {
  askMessage: boolean;
  confirmRestore: boolean;
  collapseRuns: boolean;
  collapseMinRun: number;
}

export const DEFAULT_SETTINGS: IInfinijupSettings = {
  askMessage: false,
  confirmRestore: true,
  collapseRuns: true,
  collapseMinRun: 10
};

export class InfinijupActions {
  constructor(options: InfinijupActions.IOptions) {
    this._api = options.api;
    this._tracker = options.tracker;
    this.managed = options.managed;
    this._progress = options.progress;
    this.model = options.model;
    this._getSettings = options.settings;
    this._setSetting = options.setSetting;
  }

  readonly managed: ManagedKernels;
  readonly model: HistoryModel;

  /** Emitted when an operation starts or ends on a kernel. */
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

  /** Whether snapshots and restores can run on this notebook's kernel. */
  canOperate(panel: NotebookPanel | null): boolean {
    const kernel = this.kernelOf(panel);
    return (
      !!kernel && this.managed.isManaged(kernel) && !this.isBusy(kernel.id)
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
    const kernel = this._requireKernel(panel, 'snapshot');
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
   * given), optionally starting a new thread there.
   */
  async restore(
    panel: NotebookPanel | null,
    ref?: string,
    options: { branch?: string } = {}
  ): Promise<IRestoreResult | null> {
    const op = options.branch ? 'branch' : 'restore';
    const kernel = this._requireKernel(panel, op);
    if (!panel || !kernel) {
      return null;
    }
    if (!ref) {
      ref =
        (await this.pickCommit(panel, 'Restore Kernel Snapshot')) ?? undefined;
      if (!ref) {
        return null;
      }
    }
    const label = this._describeRef(panel, ref);
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
          commit: ref,
          branch: options.branch,
          force: force || undefined
        });
        await resyncKernel(kernel);
        handle.succeed(
          `Restored ${shortId(result.commit)}` +
            `${options.branch ? ` into new thread ${result.thread}` : ` (thread ${result.thread})`}` +
            ` in ${formatSeconds(result.duration_s)}`
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

  /** Start a new thread at a commit (asking for the commit and the name). */
  async branch(
    panel: NotebookPanel | null,
    ref?: string,
    thread?: string
  ): Promise<IRestoreResult | null> {
    if (!this._requireKernel(panel, 'branch') || !panel) {
      return null;
    }
    if (!ref) {
      ref =
        (await this.pickCommit(panel, 'Branch from Kernel Snapshot')) ??
        undefined;
      if (!ref) {
        return null;
      }
    }
    const threads = this._threadsOf(panel);
    while (!thread) {
      const result = await InputDialog.getText({
        title: `Branch from ${this._describeRef(panel, ref)}`,
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
    return this.restore(panel, ref, { branch: thread });
  }

  /**
   * Ask for a commit: a list of the notebook's commits (newest first), or a
   * typed id, id prefix or thread name.
   */
  async pickCommit(
    panel: NotebookPanel,
    title: string
  ): Promise<string | null> {
    let history: IHistory | null = null;
    if (this.model.target?.path === sessionPath(panel) && this.model.history) {
      history = this.model.history;
    } else {
      const kernel = this.kernelOf(panel);
      try {
        history = await this._api.history(
          kernel ? { kernel_id: kernel.id } : { path: panel.context.path }
        );
      } catch {
        history = null; // the dialog still accepts a typed id
      }
    }
    const commits = history?.commits ?? [];
    const labels = commits.slice(0, 500).map(commitLabel);
    const result = await InputDialog.getItem({
      title,
      label: 'Commit id, id prefix (8+ hex digits) or thread name',
      items: labels,
      editable: true,
      placeholder: commits.length
        ? shortId(commits[0].id)
        : 'e.g. main or 1a2b3c4d',
      okLabel: 'Next'
    });
    if (!result.button.accept || !result.value) {
      return null;
    }
    const index = labels.indexOf(result.value);
    if (index >= 0) {
      return commits[index].id;
    }
    const typed = result.value.trim().split(/\s+/)[0];
    return typed || null;
  }

  /** Copy a commit id to the clipboard. */
  copyId(id: string): void {
    Clipboard.copyToSystem(id);
    Notification.info(`Copied ${shortId(id)}… to the clipboard`, {
      autoClose: 2000
    });
  }

  private _requireKernel(
    panel: NotebookPanel | null,
    what: string
  ): Kernel.IKernelConnection | null {
    const kernel = this.kernelOf(panel);
    if (!panel || !kernel) {
      Notification.warning(
        `Open a notebook with a running kernel to ${what}.`,
        {
          autoClose: 5000
        }
      );
      return null;
    }
    if (this.isBusy(kernel.id)) {
      Notification.warning(
        `An operation is already running on the kernel of ${name(panel)}.`,
        { autoClose: 5000 }
      );
      return null;
    }
    return kernel;
  }

  private _threadsOf(panel: NotebookPanel): { [name: string]: string } | null {
    return this.model.target?.path === sessionPath(panel) && this.model.history
      ? this.model.history.threads
      : null;
  }

  private _describeRef(panel: NotebookPanel, ref: string): string {
    const commit: ICommit | undefined =
      this.model.target?.path === sessionPath(panel)
        ? this.model.getCommit(ref)
        : undefined;
    if (commit) {
      return `snapshot ${shortId(commit.id)}${commit.message ? ` “${truncate(commit.message, 40)}”` : ''}`;
    }
    return /^[0-9a-f]{8,}$/i.test(ref)
      ? `snapshot ${shortId(ref)}`
      : `“${ref}”`;
  }

  private _refreshIfShown(panel: NotebookPanel): void {
    if (this.model.target?.path === sessionPath(panel)) {
      void this.model.refresh();
    }
  }

  private _setBusy(kernelId: string, busy: boolean): void {
    if (busy) {
      this._busy.add(kernelId);
    } else {
      this._busy.delete(kernelId);
    }
    this._busyChanged.emit(kernelId);
  }

  private _api: IInfinijupAPI;
  private _tracker: INotebookTracker;
  private _progress: ProgressTracker;
  private _getSettings: () => IInfinijupSettings;
  private _setSetting?: (
    key: keyof IInfinijupSettings,
    value: any
  ) => Promise<void>;
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
  }
}

/** "1a2b3c4d · main · message · 5 min ago" */
export function commitLabel(commit: ICommit): string {
  return [
    shortId(commit.id),
    commit.thread,
    truncate(commit.message || '(no message)', 60),
    formatAge(commit.created)
  ].join(' · ');
}

function truncate(text: string, n: number): string {
  return text.length > n ? text.slice(0, n - 1) + '…' : text;
}

/** The path the server knows the notebook's session by. */
export function sessionPath(panel: NotebookPanel): string {
  return panel.sessionContext.session?.path ?? panel.context.path;
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
