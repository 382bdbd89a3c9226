/**
 * Hibernate and wake from the UI: the "Hibernate Kernel" command and a click
 * on the "Hibernated" indicator. Failures (409 kernel_busy, a wake that did not
 * happen) become an error notification with the server's message and reason;
 * a notebook whose kernel cannot be hibernated says why.
 *
 * The notifier is injected (JupyterLab's Notification in the app, a fake in
 * tests).
 */

import { asRequestError } from './errors';
import { failureText, INotifier } from './progress';
import { RestStates } from './restState';

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
