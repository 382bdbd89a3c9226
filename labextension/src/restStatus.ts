/**
 * The rest state of a notebook's kernel on screen (issue 14): "GPU released",
 * "Hibernating…", "Hibernated", "Waking… 40%" in the notebook toolbar (beside
 * the kernel name and status), the status bar and the Kernel history panel.
 * Nothing is shown while the kernel runs. A click on "Hibernated" or "GPU
 * released" wakes the kernel.
 */

import { URLExt } from '@jupyterlab/coreutils';
import type { DocumentRegistry } from '@jupyterlab/docregistry';
import type { INotebookModel, NotebookPanel } from '@jupyterlab/notebook';
import { ServerConnection } from '@jupyterlab/services';
import { DisposableDelegate, IDisposable } from '@lumino/disposable';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { requestAPI } from './request';
import { IRestAPI, IRestStatus, restLabel, RestStates } from './restState';

/** The hibernation calls of the REST API (docs/api.md). */
export class RestClient implements IRestAPI {
  constructor(
    readonly serverSettings: ServerConnection.ISettings = ServerConnection.makeSettings()
  ) {}

  status(kernelId: string): Promise<IRestStatus> {
    return requestAPI<IRestStatus>(
      'status' + URLExt.objectToQueryString({ kernel_id: kernelId }),
      { method: 'GET' },
      this.serverSettings
    );
  }

  hibernate(kernelId: string): Promise<{ state?: string; commit?: string }> {
    return requestAPI(
      'hibernate',
      { method: 'POST', body: JSON.stringify({ kernel_id: kernelId }) },
      this.serverSettings
    );
  }

  /** Give up what waits for the kernel's running cell (docs/api.md). */
  cancel(kernelId: string): Promise<{ cancelled?: number }> {
    return requestAPI(
      'cancel',
      { method: 'POST', body: JSON.stringify({ kernel_id: kernelId }) },
      this.serverSettings
    );
  }

  wake(kernelId: string): Promise<{ state?: string }> {
    return requestAPI(
      'wake',
      { method: 'POST', body: JSON.stringify({ kernel_id: kernelId }) },
      this.serverSettings
    );
  }
}

/**
 * One place showing the rest state of one notebook's kernel. Its node has
 * `data-rest-state` (running, released, hibernating, hibernated, waking).
 */
export class RestIndicator extends Widget {
  constructor(options: RestIndicator.IOptions) {
    super({ node: document.createElement('div') });
    this._states = options.states;
    this._onWake = options.onWake;
    this.addClass('jp-Infinijup-rest');
    if (options.className) {
      this.addClass(options.className);
    }
    this._button = document.createElement('button');
    this._button.type = 'button';
    this._button.className = 'jp-Infinijup-rest-button';
    this._button.addEventListener('click', this._onClick);
    this.node.appendChild(this._button);
    this._states.changed.connect(this._onChanged, this);
    this._render();
  }

  /** Whether a rest state is shown (not while the kernel runs). */
  get isResting(): boolean {
    return this._resting;
  }

  /** Emitted when `isResting` changes (the status bar shows the item then). */
  get restingChanged(): ISignal<this, void> {
    return this._restingChanged;
  }

  /** The notebook whose kernel is shown (or none). */
  get notebook(): NotebookPanel | null {
    return this._notebook;
  }

  setNotebook(panel: NotebookPanel | null): void {
    if (panel === this._notebook) {
      return;
    }
    if (this._notebook) {
      const ctx = this._notebook.sessionContext;
      ctx.kernelChanged.disconnect(this._onKernel, this);
      ctx.statusChanged.disconnect(this._onStatus, this);
      this._notebook.disposed.disconnect(this._onGone, this);
    }
    this._notebook = panel;
    if (panel) {
      panel.sessionContext.kernelChanged.connect(this._onKernel, this);
      panel.sessionContext.statusChanged.connect(this._onStatus, this);
      panel.disposed.connect(this._onGone, this);
    }
    this._onKernel();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this.setNotebook(null);
    this._states.changed.disconnect(this._onChanged, this);
    this._button.removeEventListener('click', this._onClick);
    super.dispose();
  }

  private get _kernelId(): string | null {
    return this._notebook?.sessionContext.session?.kernel?.id ?? null;
  }

  private _onGone(): void {
    this.setNotebook(null);
  }

  private _onKernel(): void {
    const id = this._kernelId;
    if (id) {
      void this._states.refresh(id);
    }
    this._render();
  }

  private _onStatus(): void {
    // A restart or shutdown ends a rest on the server without an event.
    const status = this._notebook?.sessionContext.session?.kernel?.status;
    const id = this._kernelId;
    if (
      id &&
      (status === 'restarting' ||
        status === 'autorestarting' ||
        status === 'dead')
    ) {
      void this._states.refresh(id, true);
    }
  }

  private _onChanged(_: RestStates, kernelId: string): void {
    if (kernelId === this._kernelId) {
      this._render();
    }
  }

  private _onClick = (): void => {
    const id = this._kernelId;
    if (id && this._notebook && restLabel(this._states.get(id))?.wakes) {
      this._onWake(this._notebook, id);
    }
  };

  private _render(): void {
    const id = this._kernelId;
    const info = this._states.get(id);
    const label = id ? restLabel(info) : null;
    this.node.dataset.restState = id ? info.state : 'none';
    this.node.classList.toggle('jp-mod-resting', !!label);
    this.setHidden(!label);
    if (this._resting !== !!label) {
      this._resting = !!label;
      this._restingChanged.emit();
    }
    this._button.textContent = label?.text ?? '';
    this._button.title = label?.title ?? '';
    this._button.disabled = !label?.wakes;
    this._button.setAttribute(
      'aria-label',
      label ? `Kernel ${label.text}${label.wakes ? ': click to wake' : ''}` : ''
    );
    if (info.percent !== null && label) {
      this.node.style.setProperty(
        '--jp-infinijup-rest-progress',
        `${Math.round(info.percent)}%`
      );
    } else {
      this.node.style.removeProperty('--jp-infinijup-rest-progress');
    }
  }

  private _states: RestStates;
  private _onWake: (panel: NotebookPanel, kernelId: string) => void;
  private _button: HTMLButtonElement;
  private _notebook: NotebookPanel | null = null;
  private _resting = false;
  private _restingChanged = new Signal<this, void>(this);
}

export namespace RestIndicator {
  export interface IOptions {
    states: RestStates;
    /** Wake the kernel (a click on "Hibernated" / "GPU released"). */
    onWake: (panel: NotebookPanel, kernelId: string) => void;
    className?: string;
  }
}

/** The indicator in each notebook's toolbar, before the kernel's name. */
export class RestToolbarExtension implements DocumentRegistry.IWidgetExtension<
  NotebookPanel,
  INotebookModel
> {
  constructor(private readonly _options: RestIndicator.IOptions) {}

  createNew(panel: NotebookPanel): IDisposable {
    const indicator = new RestIndicator({
      ...this._options,
      className: 'jp-Infinijup-rest-toolbar'
    });
    if (
      !panel.toolbar.insertBefore('kernelName', 'infinijup-rest', indicator)
    ) {
      panel.toolbar.addItem('infinijup-rest', indicator);
    }
    indicator.setNotebook(panel);
    return new DisposableDelegate(() => indicator.dispose());
  }
}
