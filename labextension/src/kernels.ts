/**
 * Which kernels are managed by Infinijup (GET /infinijup/status), cached by
 * kernel id.
 */

import { ISignal, Signal } from '@lumino/signaling';

import { asRequestError } from './errors';
import { IInfinijupAPI, KERNELSPEC_NAME } from './types';

/** What the frontend knows of a kernel. */
export interface IKernelRef {
  id: string;
  /** The kernelspec name. */
  name: string;
}

export class ManagedKernels {
  constructor(private readonly _api: IInfinijupAPI) {}

  /** Emitted with the kernel id when its managed state becomes known. */
  get changed(): ISignal<this, string> {
    return this._changed;
  }

  /**
   * Whether a kernel is managed: the server's answer when known, else a
   * guess from the kernelspec name (and a status request is started).
   */
  isManaged(kernel: IKernelRef | null | undefined): boolean {
    if (!kernel) {
      return false;
    }
    const known = this._managed.get(kernel.id);
    if (known !== undefined) {
      return known;
    }
    void this.check(kernel);
    return kernel.name === KERNELSPEC_NAME;
  }

  /** Ask the server (once per kernel id, unless `force`). */
  check(kernel: IKernelRef, force = false): Promise<boolean> {
    let pending = this._pending.get(kernel.id);
    if (!pending || force) {
      pending = this._api.status(kernel.id).then(
        status => !!status?.managed,
        error => {
          // A server without the extension, or a transient failure: trust the
          // kernelspec (an operation will then report the real error).
          console.warn(
            `Infinijup: status of kernel ${kernel.id} unknown: ${asRequestError(error).describe()}`
          );
          return kernel.name === KERNELSPEC_NAME;
        }
      );
      this._pending.set(kernel.id, pending);
      void pending.then(managed => {
        const before = this._managed.get(kernel.id);
        this._managed.set(kernel.id, managed);
        if (before !== managed) {
          this._changed.emit(kernel.id);
        }
      });
    }
    return pending;
  }

  /** Forget a kernel (it was shut down). */
  forget(kernelId: string): void {
    this._managed.delete(kernelId);
    this._pending.delete(kernelId);
  }

  private _managed = new Map<string, boolean>();
  private _pending = new Map<string, Promise<boolean>>();
  private _changed = new Signal<this, string>(this);
}
