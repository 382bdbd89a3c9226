/**
 * Which snapshot a notebook's kernel is in, in the notebook's toolbar (issue
 * 28): "at 1a2b3c4d" once the kernel stands on a snapshot (it took one, or
 * was restored or resumed from one), "no snapshot" after a start or a
 * restart. A restore rewinds the execution counts; this says where the kernel
 * now is. A click opens the Kernel history. Nothing is shown for a kernel
 * Infinijup does not manage.
 *
 * The server is the one truth (GET /infinijup/status, its `head`): the label
 * asks again after every finished operation of its kernel and after a restart,
 * rather than guess from events (a hibernation kept aside, for one, leaves
 * HEAD where it was).
 */

import type { DocumentRegistry } from '@jupyterlab/docregistry';
import type { INotebookModel, NotebookPanel } from '@jupyterlab/notebook';
import { DisposableDelegate, IDisposable } from '@lumino/disposable';
import { Widget } from '@lumino/widgets';

import { shortId } from './format';

/** The fields of GET /infinijup/status read here. */
export interface IHeadStatus {
  managed?: boolean;
  head?: { commit?: string | null; thread?: string | null } | null;
}

export interface IHeadAPI {
  status(kernelId: string): Promise<IHeadStatus>;
}

/** What the label shows; null: nothing (no kernel, or not Infinijup's). */
export interface IHeadText {
  text: string;
  title: string;
}

export function headText(
  status: IHeadStatus | null | undefined
): IHeadText | null {
  if (!status || status.managed === false) {
    return null;
  }
  const commit = status.head?.commit;
  if (!commit) {
    return {
      text: 'no snapshot',
      title:
        'This kernel comes from no snapshot: it was started or restarted since. Its next snapshot starts a new root. Click to open the Kernel history.'
    };
  }
  const thread = status.head?.thread;
  return {
    text: `at ${shortId(commit)}`,
    title:
      `This kernel is in snapshot ${shortId(commit)}${thread ? ` (thread ${thread})` : ' (no thread tip)'}: ` +
      'its variables are as that snapshot saved them, plus whatever ran since. ' +
      'After a restore the execution counts start again from the snapshot’s. Click to open the Kernel history.'
  };
}

/** The label of one notebook. */
export class HeadLabel extends Widget {
  constructor(private readonly _options: HeadLabel.IOptions) {
    super({ node: document.createElement('button') });
    this.addClass('jp-Infinijup-head');
    (this.node as HTMLButtonElement).type = 'button';
    this.node.addEventListener('click', this._onClick);
    this.hide();
  }

  get kernelId(): string | null {
    return this._panel?.sessionContext.session?.kernel?.id ?? null;
  }

  setNotebook(panel: NotebookPanel): void {
    this._panel = panel;
    panel.sessionContext.kernelChanged.connect(this.refresh, this);
    panel.sessionContext.statusChanged.connect(this._onStatus, this);
    this.refresh();
  }

  /** Ask the server where the kernel is now. */
  refresh(): void {
    const id = this.kernelId;
    const asked = ++this._asked;
    if (!id) {
      this._render(null);
      return;
    }
    this._options.api.status(id).then(
      status => asked === this._asked && this._render(headText(status)),
      () => asked === this._asked && this._render(null)
    );
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this.node.removeEventListener('click', this._onClick);
    const ctx = this._panel?.sessionContext;
    ctx?.kernelChanged.disconnect(this.refresh, this);
    ctx?.statusChanged.disconnect(this._onStatus, this);
    super.dispose();
  }

  private _onStatus(_: unknown, status: string): void {
    if (status === 'restarting' || status === 'autorestarting') {
      this._restarting = true;
    } else if (status === 'idle' && this._restarting) {
      this._restarting = false;
      this.refresh();
    }
  }

  private _render(shown: IHeadText | null): void {
    if (!shown) {
      this.hide();
      return;
    }
    this.node.textContent = shown.text;
    this.node.title = shown.title;
    this.node.dataset.head = shown.text.startsWith('at ')
      ? shown.text.slice(3)
      : '';
    this.show();
  }

  private _onClick = () => this._options.onOpen();

  private _panel: NotebookPanel | null = null;
  private _asked = 0;
  private _restarting = false;
}

export namespace HeadLabel {
  export interface IOptions {
    api: IHeadAPI;
    /** Open the Kernel history. */
    onOpen: () => void;
  }
}

/** Puts a HeadLabel in every notebook's toolbar, and tells them of operations. */
export class HeadToolbarExtension implements DocumentRegistry.IWidgetExtension<
  NotebookPanel,
  INotebookModel
> {
  constructor(private readonly _options: HeadLabel.IOptions) {}

  createNew(panel: NotebookPanel): IDisposable {
    const label = new HeadLabel(this._options);
    if (!panel.toolbar.insertBefore('kernelName', 'infinijup-head', label)) {
      panel.toolbar.addItem('infinijup-head', label);
    }
    label.setNotebook(panel);
    this._labels.add(label);
    return new DisposableDelegate(() => {
      this._labels.delete(label);
      label.dispose();
    });
  }

  /** An operation event: once one of a kernel's operations ends, its label asks again. */
  handleEvent(event: { kernel_id: string; phase: string }): void {
    if (event.phase !== 'done' && event.phase !== 'error') {
      return;
    }
    for (const label of this._labels) {
      if (label.kernelId === event.kernel_id) {
        label.refresh();
      }
    }
  }

  private _labels = new Set<HeadLabel>();
}
