/**
 * Progress notifications of snapshots and restores.
 *
 * An operation started from this tab (`begin`) gets a notification at once;
 * the server's events (`handleEvent`) move its progress bar through the
 * phases, and the HTTP reply finishes it (`succeed` / `fail`). Operations
 * started elsewhere (the `%snapshot` magic, another tab) on a kernel this tab
 * shows get a notification from their events alone.
 *
 * The notifier is injected (JupyterLab's `Notification` in the app, a fake in
 * tests), so this module has no JupyterLab imports.
 */

import { asRequestError } from './errors';
import { shortId } from './format';
import {
  IOperationEvent,
  OperationKind,
  OperationPhase,
  PHASE_LABELS
} from './types';

export type NotificationKind =
  'info' | 'in-progress' | 'success' | 'warning' | 'error' | 'default';

/** Options of a notification. */
export interface INotifyOptions {
  autoClose?: number | false;
  /** Progress, 0 to 1. */
  progress?: number;
  /** The full error, for a "Details" action (messages are cut at 140). */
  details?: { title: string; message: string; reason: string };
  /** Give up waiting (a "Cancel" action while the kernel runs a cell). */
  cancel?: () => void;
}

/**
 * The subset of JupyterLab's Notification API used here (the app adapts
 * `details` to an action button).
 */
export interface INotifier {
  emit(
    message: string,
    type: NotificationKind,
    options?: INotifyOptions
  ): string;
  update(
    args: {
      id: string;
      message: string;
      type?: NotificationKind;
    } & INotifyOptions
  ): boolean;
  dismiss(id?: string): void;
}

const OP_LABELS: { [op in OperationKind]: string } = {
  snapshot: 'Snapshot',
  restore: 'Restore',
  resume: 'Resume'
};

/** Notifications longer than this are cut by JupyterLab. */
const MAX_MESSAGE = 140;
/** When a final state is applied again, in `settleMs` after the update. */
const FINAL_AGAIN = [4, 16, 64];

export class ProgressTracker {
  constructor(options: ProgressTracker.IOptions) {
    this._notifier = options.notifier;
    this._isRelevant = options.isRelevant ?? (() => true);
    this._describe = options.describe ?? (ev => ev.path || ev.kernel_id);
    this._successAutoClose = options.successAutoClose ?? 5000;
    this._settleMs = options.settleMs ?? 250;
    this._onCancel = options.onCancel ?? null;
  }

  /**
   * A "Cancel" for an operation still waiting for the kernel's running cell
   * (POST /infinijup/cancel); null where none can be offered.
   *
   * @internal
   */
  _cancelFor(handle: OperationHandle, phase: string): (() => void) | null {
    const onCancel = this._onCancel;
    if (!onCancel || !handle.kernelId) {
      return null;
    }
    return phase === 'queued' || phase === 'quiesce'
      ? () => onCancel(handle.kernelId)
      : null;
  }

  /**
   * Start tracking an operation this tab is starting.
   *
   * @param kernelId - the kernel; '' for a resume (its kernel is not known
   *   yet: its events are matched by notebook path).
   * @param label - e.g. "Snapshot of analysis.ipynb".
   * @param path - the notebook's path (matches resume events).
   */
  begin(
    op: OperationKind,
    kernelId: string,
    label: string,
    path = ''
  ): OperationHandle {
    const handle = new OperationHandle(this, op, kernelId, label, path);
    this._handles.push(handle);
    return handle;
  }

  /** Take an operation event from the event bus. */
  handleEvent(event: IOperationEvent): void {
    let handle = this._byOpId.get(event.op_id);
    if (!handle) {
      const pending = this._handles.filter(h => !h.opId && !h.finished);
      handle =
        pending.find(
          h =>
            h.op === event.op && !!h.kernelId && h.kernelId === event.kernel_id
        ) ??
        // A resume's kernel is new: match by the notebook's path (or its
        // copy). The server may report a resume's phases as a restore into
        // the kernel it started.
        pending.find(
          h =>
            !h.kernelId &&
            h.op === 'resume' &&
            (event.op === 'resume' || event.op === 'restore') &&
            samePathOrCopy(h.path, event.path)
        );
      if (handle) {
        handle.opId = event.op_id;
        this._byOpId.set(event.op_id, handle);
      } else if (
        !this._finishedOps.has(event.op_id) &&
        this._isRelevant(event)
      ) {
        const label = `${OP_LABELS[event.op]} of ${this._describe(event)}`;
        handle = new OperationHandle(
          this,
          event.op,
          event.kernel_id,
          label,
          event.path
        );
        handle.opId = event.op_id;
        handle.external = true;
        this._handles.push(handle);
        this._byOpId.set(event.op_id, handle);
      }
    }
    if (!handle || handle.finished) {
      return;
    }
    handle.onEvent(event);
  }

  /** Operations not finished yet. */
  get active(): readonly OperationHandle[] {
    return this._handles.filter(h => !h.finished);
  }

  /**
   * Show or update the notification of an operation.
   *
   * JupyterLab creates toasts asynchronously and drops an update that comes
   * before the toast is on screen (the toast keeps its first message), so
   * updates within `settleMs` of the first message are deferred (coalesced),
   * and a final state is applied again 4, 16 and 64 `settleMs` later.
   *
   * @internal
   */
  _notify(
    handle: OperationHandle,
    message: string,
    type: NotificationKind,
    options: INotifyOptions,
    final = false
  ): void {
    message = truncate(message);
    if (handle.notificationId === null) {
      handle.notificationId = this._notifier.emit(message, type, options);
      handle.emittedAt = Date.now();
      return;
    }
    const args = { id: handle.notificationId, message, type, ...options };
    const settle = this._settleMs;
    const wait = handle.emittedAt + settle - Date.now();
    if (settle > 0 && wait > 0) {
      handle.pendingUpdate = args;
      if (handle.timer === null) {
        handle.timer = setTimeout(() => {
          handle.timer = null;
          const pending = handle.pendingUpdate;
          handle.pendingUpdate = null;
          if (pending) {
            this._notifier.update(pending);
          }
        }, wait);
      }
    } else {
      if (handle.timer !== null) {
        clearTimeout(handle.timer);
        handle.timer = null;
        handle.pendingUpdate = null;
      }
      this._notifier.update(args);
    }
    if (final && settle > 0) {
      // A toast a loaded browser puts on screen late keeps its first message
      // ("starting…"): the final state is applied again, later each time.
      for (const times of FINAL_AGAIN) {
        setTimeout(
          () => this._notifier.update(args),
          Math.max(0, wait) + times * settle
        );
      }
    }
  }

  /** @internal */
  _finished(handle: OperationHandle): void {
    this._handles = this._handles.filter(h => h !== handle);
    if (handle.opId) {
      this._finishedOps.add(handle.opId);
      this._byOpId.delete(handle.opId);
      if (this._finishedOps.size > 1000) {
        this._finishedOps = new Set([...this._finishedOps].slice(-500));
      }
    }
  }

  /** @internal */
  get _successDelay(): number {
    return this._successAutoClose;
  }

  private _notifier: INotifier;
  private _isRelevant: (event: IOperationEvent) => boolean;
  private _describe: (event: IOperationEvent) => string;
  private _successAutoClose: number;
  private _settleMs: number;
  private _onCancel: ((kernelId: string) => void) | null;
  private _handles: OperationHandle[] = [];
  private _byOpId = new Map<string, OperationHandle>();
  private _finishedOps = new Set<string>();
}

export namespace ProgressTracker {
  export interface IOptions {
    notifier: INotifier;
    /** Whether an operation not started here deserves a notification. */
    isRelevant?: (event: IOperationEvent) => boolean;
    /** What to call the notebook of an event (default: its path). */
    describe?: (event: IOperationEvent) => string;
    /** Milliseconds before a success notification closes (default 5000). */
    successAutoClose?: number;
    /**
     * Milliseconds a new notification is left alone before it is updated
     * (default 250; 0 updates at once, for tests).
     */
    settleMs?: number;
    /** Give up what waits for a busy kernel (offered while it waits). */
    onCancel?: (kernelId: string) => void;
  }
}

/** One tracked operation and its notification. */
export class OperationHandle {
  constructor(
    private readonly _tracker: ProgressTracker,
    readonly op: OperationKind,
    readonly kernelId: string,
    readonly label: string,
    readonly path = ''
  ) {
    this._tracker._notify(this, `${label}: starting…`, 'in-progress', {
      autoClose: false,
      progress: 0
    });
  }

  /** The server's op id, once an event told it. */
  opId: string | null = null;
  /** Started elsewhere: finished by its events. */
  external = false;
  notificationId: string | null = null;
  /** When the notification was first shown (ms since the epoch). */
  emittedAt = 0;
  /** @internal */
  pendingUpdate:
    | ({ id: string; message: string; type: NotificationKind } & INotifyOptions)
    | null = null;
  /** @internal */
  timer: ReturnType<typeof setTimeout> | null = null;
  /** The last phase seen. */
  phase: OperationPhase | null = null;
  percent = 0;

  get finished(): boolean {
    return this._finished;
  }

  /** @internal */
  onEvent(event: IOperationEvent): void {
    this.phase = event.phase;
    if (event.phase === 'done') {
      if (this.external) {
        const what =
          event.op === 'snapshot'
            ? `Snapshot ${shortId(event.commit)} saved`
            : event.op === 'resume'
              ? `Resumed ${shortId(event.commit)}`
              : `Restored ${shortId(event.commit)}`;
        this.succeed(
          `${what}${event.thread ? ` on ${event.thread}` : ''} (${this.label.replace(
            /^\w+ of /,
            ''
          )})`
        );
      } else {
        this.percent = 100;
        this._tracker._notify(
          this,
          `${this.label}: finishing ${progressBar(100)} 100%`,
          'in-progress',
          {
            autoClose: false,
            progress: 1
          }
        );
      }
      return;
    }
    if (event.phase === 'error') {
      const text = failureText(
        this.label,
        event.message || 'failed',
        event.reason
      );
      if (this.external) {
        this._finish(text, 'error', false, event.message, event.reason);
      } else {
        this._errorEvent = { message: event.message, reason: event.reason };
        this._tracker._notify(this, text, 'in-progress', {
          autoClose: false,
          progress: this.percent / 100
        });
      }
      return;
    }
    // Progress only moves forward (events may be reordered by the bus).
    this.percent = Math.max(this.percent, event.percent);
    const detail = event.message ? ` · ${event.message}` : '';
    const cancel = this._tracker._cancelFor(this, event.phase);
    this._tracker._notify(
      this,
      `${this.label}: ${PHASE_LABELS[event.phase] ?? event.phase} ${progressBar(
        this.percent
      )} ${Math.round(this.percent)}%${detail}`,
      'in-progress',
      {
        autoClose: false,
        progress: this.percent / 100,
        ...(cancel ? { cancel } : {})
      }
    );
  }

  /** Finish with success. */
  succeed(message: string): void {
    this._finish(message, 'success', this._tracker._successDelay);
  }

  /** Finish with an error (the server's message and reason). */
  fail(error: unknown): void {
    const err = asRequestError(error);
    const message = err.message || this._errorEvent?.message || 'failed';
    const reason = err.message ? err.reason : this._errorEvent?.reason;
    this._finish(
      failureText(this.label, message, reason),
      'error',
      false,
      message,
      reason
    );
  }

  /** Drop the notification (e.g. the user cancelled before anything ran). */
  cancel(): void {
    if (!this._finished) {
      this._finished = true;
      this._tracker._finished(this);
    }
  }

  private _finish(
    message: string,
    type: NotificationKind,
    autoClose: number | false,
    detail?: string,
    reason?: string
  ): void {
    if (this._finished) {
      return;
    }
    this._finished = true;
    const options: INotifyOptions = { autoClose };
    if (type === 'error' && detail) {
      options.details = {
        title: `${this.label} failed`,
        message: detail,
        reason: reason ?? ''
      };
    }
    this._tracker._notify(this, message, type, options, true);
    this._tracker._finished(this);
  }

  private _finished = false;
  private _errorEvent: { message: string; reason?: string } | null = null;
}

/**
 * Whether an event's notebook is `path` or the copy a resume into a new
 * notebook makes of it ("<dir>/<stem>-<suffix>.ipynb").
 */
export function samePathOrCopy(path: string, eventPath: string): boolean {
  if (!path || !eventPath) {
    return false;
  }
  if (path === eventPath) {
    return true;
  }
  const slash = path.lastIndexOf('/');
  const dir = path.slice(0, slash + 1);
  const stem = path.slice(slash + 1).replace(/\.ipynb$/, '');
  return (
    eventPath.startsWith(`${dir}${stem}-`) &&
    !eventPath.slice(dir.length).includes('/') &&
    eventPath.endsWith('.ipynb')
  );
}

function truncate(message: string): string {
  return message.length > MAX_MESSAGE
    ? message.slice(0, MAX_MESSAGE - 1) + '…'
    : message;
}

/**
 * A text progress bar: JupyterLab's toasts show the message as text (the
 * `progress` option is kept for the notification center and future UIs).
 */
export function progressBar(percent: number, width = 10): string {
  const full = Math.round((Math.max(0, Math.min(100, percent)) / 100) * width);
  return '█'.repeat(full) + '░'.repeat(width - full);
}

/**
 * "<label> failed: <message> (<reason>)", within the 140 characters JupyterLab
 * shows: the message is cut, never the reason.
 */
export function failureText(
  label: string,
  message: string,
  reason?: string
): string {
  // The reasons whose messages are too long to read whole in a toast say it
  // short (the whole message is behind "Details").
  if (reason === 'kernel_busy') {
    message =
      'the kernel is running a cell: interrupt it or retry when it ends';
  } else if (reason === 'cancelled') {
    return `${label} cancelled: the running cell goes on`;
  }
  const head = `${label} failed: `;
  const tail = reason ? ` (${reason})` : '';
  const room = MAX_MESSAGE - head.length - tail.length;
  const body =
    message.length > room
      ? message.slice(0, Math.max(0, room - 1)) + '…'
      : message;
  return head + body + tail;
}
