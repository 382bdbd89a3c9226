/**
 * The rest state of kernels (issue 14): running, GPU released, hibernating,
 * hibernated or waking, as the server tells it through GET /infinijup/status
 * and the operation events (`op` hibernate / release / wake with
 * `kernel_state`, and the snapshot / restore events of the same kernel for
 * progress).
 *
 * No JupyterLab imports: the reducer is pure, the store takes an injected API.
 */

import { ISignal, Signal } from '@lumino/signaling';

import { asRequestError } from './errors';
import { shortId } from './format';
import { EVENT_SCHEMA_ID } from './types';

export type RestState =
  'running' | 'released' | 'hibernating' | 'hibernated' | 'waking';

const REST_STATES: readonly string[] = [
  'running',
  'released',
  'hibernating',
  'hibernated',
  'waking'
];

/** What is known of one kernel's rest. */
export interface IRestInfo {
  state: RestState;
  /** Progress of the transition now under way (hibernating, waking), 0-100, or null. */
  percent: number | null;
  /** The snapshot a hibernated kernel wakes from, when known. */
  commit: string | null;
  /** The last failure (a wake that did not happen, a hibernation refused). */
  error: { message: string; reason: string } | null;
}

export const RUNNING: IRestInfo = {
  state: 'running',
  percent: null,
  commit: null,
  error: null
};

/** An operation event as far as the rest state needs it. */
export interface IRestEvent {
  op: string;
  kernel_id: string;
  phase: string;
  percent: number;
  message: string;
  /** Only on hibernate / release / wake events. */
  kernel_state?: RestState;
  commit?: string;
  reason?: string;
}

/** GET /infinijup/status, the fields read here (older servers lack `state`). */
export interface IRestStatus {
  state?: string;
  operation?: { op: string; phase: string; percent: number } | null;
  head?: { commit?: string | null } | null;
}

/** The server calls of hibernation. */
export interface IRestAPI {
  status(kernelId: string): Promise<IRestStatus>;
  hibernate(
    kernelId: string
  ): Promise<{ state?: string; commit?: string | null }>;
  wake(kernelId: string): Promise<{ state?: string }>;
}

/** Parse an event-bus emission, or null when it is no operation event. */
export function parseRestEvent(emission: {
  [key: string]: any;
}): IRestEvent | null {
  if (!emission || emission.schema_id !== EVENT_SCHEMA_ID) {
    return null;
  }
  const { op, kernel_id, phase } = emission;
  if (
    typeof op !== 'string' ||
    typeof kernel_id !== 'string' ||
    typeof phase !== 'string'
  ) {
    return null;
  }
  const percent = Number(emission.percent);
  const state = emission.kernel_state;
  return {
    op,
    kernel_id,
    phase,
    percent: Number.isFinite(percent) ? Math.max(0, Math.min(100, percent)) : 0,
    message: typeof emission.message === 'string' ? emission.message : '',
    kernel_state:
      typeof state === 'string' && REST_STATES.includes(state)
        ? (state as RestState)
        : undefined,
    commit: typeof emission.commit === 'string' ? emission.commit : undefined,
    reason: typeof emission.reason === 'string' ? emission.reason : undefined
  };
}

/** The next rest info of a kernel after one of its events. */
export function applyEvent(info: IRestInfo, event: IRestEvent): IRestInfo {
  const restOp =
    event.op === 'hibernate' || event.op === 'release' || event.op === 'wake';
  if (restOp && event.kernel_state) {
    const state = event.kernel_state;
    const error =
      event.phase === 'error'
        ? {
            message: event.message || `${event.op} failed`,
            reason: event.reason ?? 'error'
          }
        : null;
    return {
      state,
      percent: state === 'waking' ? Math.max(0, event.percent) : null,
      commit:
        state === 'running'
          ? null
          : state === 'hibernated'
            ? (event.commit ?? info.commit)
            : info.commit,
      error
    };
  }
  // A wake restores the kernel's snapshot, a hibernation takes one: their
  // events give the progress.
  if (
    (info.state === 'waking' && event.op === 'restore') ||
    (info.state === 'hibernating' && event.op === 'snapshot')
  ) {
    if (event.phase === 'error' || event.phase === 'done') {
      return info;
    }
    return { ...info, percent: Math.max(info.percent ?? 0, event.percent) };
  }
  // A restore the user asked for gives a hibernated kernel its process back
  // (the server then holds nothing: no wake event follows).
  if (
    info.state === 'hibernated' &&
    (event.op === 'restore' || event.op === 'resume') &&
    event.phase === 'done'
  ) {
    return { ...RUNNING };
  }
  return info;
}

/** The rest info a /status reply tells. */
export function fromStatus(status: IRestStatus | null | undefined): IRestInfo {
  const state =
    status &&
    typeof status.state === 'string' &&
    REST_STATES.includes(status.state)
      ? (status.state as RestState)
      : 'running';
  const op = status?.operation;
  const transition = state === 'waking' || state === 'hibernating';
  return {
    state,
    percent: transition
      ? op && typeof op.percent === 'number'
        ? Math.max(0, Math.min(100, op.percent))
        : 0
      : null,
    commit:
      state === 'hibernated' && typeof status?.head?.commit === 'string'
        ? status.head.commit
        : null,
    error: null
  };
}

/** What the UI shows for a rest state; null while the kernel simply runs. */
export interface IRestLabel {
  text: string;
  title: string;
  /** Clicking wakes the kernel. */
  wakes: boolean;
}

export function restLabel(
  info: IRestInfo | null | undefined
): IRestLabel | null {
  if (!info) {
    return null;
  }
  const failed = info.error
    ? ` Last attempt failed: ${info.error.message} (${info.error.reason}).`
    : '';
  const pct =
    info.percent !== null && info.percent > 0
      ? ` ${Math.round(info.percent)}%`
      : '';
  switch (info.state) {
    case 'running':
      return null;
    case 'released':
      return {
        text: 'GPU released',
        title:
          'The kernel is idle and its GPU memory was moved to host memory, so the GPU is free for others. The next cell (or a click here) brings it back.' +
          failed,
        wakes: true
      };
    case 'hibernating':
      return {
        text: `Hibernating…${pct}`,
        title:
          'The kernel is being saved to a snapshot; then its process ends.',
        wakes: false
      };
    case 'hibernated':
      return {
        text: 'Hibernated',
        title:
          `The kernel was saved${info.commit ? ` in snapshot ${shortId(info.commit)}` : ''} and has no process (no memory, no GPU). Run a cell, or click here, to wake it with all its variables.` +
          failed,
        wakes: true
      };
    case 'waking':
      return {
        text: `Waking…${pct}`,
        title:
          'The kernel is coming back; the cells you ran meanwhile run once it is awake, in order.',
        wakes: false
      };
  }
}

/**
 * The rest state of every kernel this tab has seen: events move it, a
 * /status request fills it for a kernel seen for the first time (a notebook
 * opened on a hibernated kernel).
 */
export class RestStates {
  constructor(private readonly _api: IRestAPI) {}

  /** Emitted with the kernel id whose rest info changed. */
  get changed(): ISignal<this, string> {
    return this._changed;
  }

  /** The rest info of a kernel (running when unknown). */
  get(kernelId: string | null | undefined): IRestInfo {
    return (kernelId && this._infos.get(kernelId)) || RUNNING;
  }

  /** Whether /status was asked (or an event told) for this kernel. */
  known(kernelId: string): boolean {
    return this._infos.has(kernelId) || this._asking.has(kernelId);
  }

  /** Take an emission of the event bus. */
  handleEmission(emission: { [key: string]: any }): void {
    const event = parseRestEvent(emission);
    if (event) {
      this.handleEvent(event);
    }
  }

  handleEvent(event: IRestEvent): void {
    const id = event.kernel_id;
    this._seq.set(id, (this._seq.get(id) ?? 0) + 1);
    this._set(id, applyEvent(this.get(id), event));
  }

  /**
   * Ask the server for a kernel's state (once unless `force`). A reply is
   * dropped when an event of the kernel came while it was on its way: the
   * event is newer.
   */
  async refresh(kernelId: string, force = false): Promise<IRestInfo> {
    if (!force && this.known(kernelId)) {
      return this.get(kernelId);
    }
    const seq = this._seq.get(kernelId) ?? 0;
    this._asking.add(kernelId);
    try {
      const status = await this._api.status(kernelId);
      if ((this._seq.get(kernelId) ?? 0) === seq) {
        this._set(kernelId, fromStatus(status));
      }
    } catch (error) {
      // Not an Infinijup kernel, or the extension is missing: it runs.
      console.debug(
        `Infinijup: rest state of ${kernelId} unknown: ${asRequestError(error).describe()}`
      );
    } finally {
      this._asking.delete(kernelId);
    }
    return this.get(kernelId);
  }

  /**
   * Hibernate a kernel; shows "Hibernating…" until the reply (or the
   * events). Throws the server's error (409 kernel_busy) after going back to
   * what the server says.
   */
  async hibernate(kernelId: string): Promise<IRestInfo> {
    const before = this.get(kernelId);
    this._bump(kernelId);
    this._set(kernelId, { ...RUNNING, state: 'hibernating', percent: 0 });
    try {
      const reply = await this._api.hibernate(kernelId);
      // Unless an event told something newer (a wake already).
      if (this.get(kernelId).state === 'hibernating') {
        this._bump(kernelId);
        this._set(kernelId, {
          ...RUNNING,
          state: 'hibernated',
          commit: typeof reply?.commit === 'string' ? reply.commit : null
        });
      }
      return this.get(kernelId);
    } catch (error) {
      if (this.get(kernelId).state === 'hibernating') {
        this._set(kernelId, before);
      }
      void this.refresh(kernelId, true);
      throw error;
    }
  }

  /** Wake a resting kernel (the server answers once it is awake). */
  async wake(kernelId: string): Promise<IRestInfo> {
    const before = this.get(kernelId);
    if (before.state === 'running' || before.state === 'waking') {
      return before;
    }
    this._bump(kernelId);
    this._set(kernelId, {
      ...before,
      state: 'waking',
      percent: 0,
      error: null
    });
    try {
      const reply = await this._api.wake(kernelId);
      if (reply?.state === 'running' && this.get(kernelId).state === 'waking') {
        this._bump(kernelId);
        this._set(kernelId, { ...RUNNING });
      }
      return this.get(kernelId);
    } catch (error) {
      const err = asRequestError(error);
      if (this.get(kernelId).state === 'waking') {
        this._set(kernelId, {
          ...before,
          error: { message: err.message, reason: err.reason }
        });
      }
      void this.refresh(kernelId, true);
      throw error;
    }
  }

  /** Forget a kernel (shut down, restarted). */
  forget(kernelId: string): void {
    this._bump(kernelId);
    if (this._infos.delete(kernelId)) {
      this._changed.emit(kernelId);
    }
  }

  private _bump(kernelId: string): number {
    const seq = (this._seq.get(kernelId) ?? 0) + 1;
    this._seq.set(kernelId, seq);
    return seq;
  }

  private _set(kernelId: string, info: IRestInfo): void {
    const old = this._infos.get(kernelId);
    this._infos.set(kernelId, info);
    if (
      !old ||
      old.state !== info.state ||
      old.percent !== info.percent ||
      old.commit !== info.commit ||
      old.error?.message !== info.error?.message
    ) {
      this._changed.emit(kernelId);
    }
  }

  private _infos = new Map<string, IRestInfo>();
  private _seq = new Map<string, number>();
  private _asking = new Set<string>();
  private _changed = new Signal<this, string>(this);
}
