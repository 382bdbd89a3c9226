/**
 * Undo and redo of cells, and the kernel's automatic snapshots (issue 30; the
 * server's undo.py and the kernel's autosnap.py).
 *
 * Undo brings the kernel back to the state before the last cell that
 * changed it; the notification says where ("Back to after [11] df = load()",
 * "3 cells back, …: cells [12]-[13] were too quick to snapshot"). Nothing is
 * lost: Redo returns. The actions take an injected API and notifier.
 */

import { ServerConnection } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import { asRequestError } from './errors';
import type { INotifier } from './progress';
import { requestAPI } from './request';

export interface IUndoResult {
  commit: string;
  /** The state left (HEAD, or the snapshot taken first). */
  from: string;
  /** The state left was snapshotted first (it had changed since HEAD). */
  saved: boolean;
  says: string;
  duration_s?: number;
}

export interface IAutosnapshot {
  installed?: boolean;
  on?: boolean;
  share?: number;
  after_s?: number;
}

export interface IUndoAPI {
  undo(kernelId: string): Promise<IUndoResult>;
  redo(kernelId: string): Promise<IUndoResult>;
  autosnapshot(kernelId: string, on?: boolean): Promise<IAutosnapshot>;
}

export class UndoClient implements IUndoAPI {
  constructor(
    readonly serverSettings: ServerConnection.ISettings = ServerConnection.makeSettings()
  ) {}

  undo(kernelId: string): Promise<IUndoResult> {
    return this._post('undo', { kernel_id: kernelId });
  }

  redo(kernelId: string): Promise<IUndoResult> {
    return this._post('redo', { kernel_id: kernelId });
  }

  autosnapshot(kernelId: string, on?: boolean): Promise<IAutosnapshot> {
    return this._post('autosnapshot', {
      kernel_id: kernelId,
      ...(on === undefined ? {} : { on })
    });
  }

  private _post<T>(route: string, body: object): Promise<T> {
    return requestAPI<T>(
      route,
      { method: 'POST', body: JSON.stringify(body) },
      this.serverSettings
    );
  }
}

/** The undo and redo of each kernel this tab asked for. */
export class UndoActions {
  constructor(
    private readonly _api: IUndoAPI,
    private readonly _notifier: INotifier
  ) {}

  /** Emitted when what can be done changes (a move starts or ends). */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** A move of this kernel is under way. */
  isBusy(kernelId: string | null | undefined): boolean {
    return !!kernelId && this._busy.has(kernelId);
  }

  /** Undos this tab made on the kernel that a redo can return from. */
  redoable(kernelId: string | null | undefined): number {
    return (kernelId && this._redos.get(kernelId)) || 0;
  }

  undo(kernelId: string, label: string): Promise<IUndoResult | null> {
    return this._move('undo', kernelId, label);
  }

  redo(kernelId: string, label: string): Promise<IUndoResult | null> {
    return this._move('redo', kernelId, label);
  }

  private async _move(
    what: 'undo' | 'redo',
    kernelId: string,
    label: string
  ): Promise<IUndoResult | null> {
    if (this._busy.has(kernelId)) {
      return null;
    }
    this._busy.add(kernelId);
    this._changed.emit();
    const id = this._notifier.emit(
      `${what === 'undo' ? 'Undoing' : 'Redoing'} (${label})…`,
      'in-progress',
      { autoClose: false }
    );
    try {
      const result =
        what === 'undo'
          ? await this._api.undo(kernelId)
          : await this._api.redo(kernelId);
      const n = this.redoable(kernelId) + (what === 'undo' ? 1 : -1);
      this._redos.set(kernelId, Math.max(0, n));
      this._notifier.update({
        id,
        message:
          `${result.says} (${label})` +
          (what === 'undo' ? ' · Redo brings it back' : ''),
        type: 'success',
        autoClose: 8000
      });
      return result;
    } catch (reason) {
      const err = asRequestError(reason);
      if (err.reason === 'nothing_to_redo') {
        this._redos.delete(kernelId);
      }
      this._notifier.update({
        id,
        message: `${what === 'undo' ? 'Undo' : 'Redo'} (${label}): ${err.message}`,
        type: err.reason.startsWith('nothing_to') ? 'info' : 'error',
        autoClose: err.reason.startsWith('nothing_to') ? 6000 : false
      });
      return null;
    } finally {
      this._busy.delete(kernelId);
      this._changed.emit();
    }
  }

  private _busy = new Set<string>();
  private _redos = new Map<string, number>();
  private _changed = new Signal<this, void>(this);
}
