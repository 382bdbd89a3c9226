/**
 * The Snapshot and Undo buttons of the notebook toolbar, shown for kernels
 * managed by Infinijup only.
 */

import type { DocumentRegistry } from '@jupyterlab/docregistry';
import type { INotebookModel, NotebookPanel } from '@jupyterlab/notebook';
import type { Kernel } from '@jupyterlab/services';
import { ToolbarButton, undoIcon } from '@jupyterlab/ui-components';
import type { CommandRegistry } from '@lumino/commands';
import { DisposableDelegate, IDisposable } from '@lumino/disposable';
import type { ISignal } from '@lumino/signaling';

import type { InfinijupActions } from './actions';
import { CommandIDs } from './commandids';
import { snapshotIcon } from './icons';

export class SnapshotButtonExtension implements DocumentRegistry.IWidgetExtension<
  NotebookPanel,
  INotebookModel
> {
  constructor(
    private readonly _commands: CommandRegistry,
    private readonly _actions: InfinijupActions
  ) {}

  createNew(panel: NotebookPanel): IDisposable {
    const commands = this._commands;
    const actions = this._actions;
    const button = new ToolbarButton({
      className: 'jp-Infinijup-snapshotButton',
      icon: snapshotIcon,
      label: 'Snapshot',
      tooltip: 'Snapshot the kernel: save its whole state (Ctrl+Alt+S)',
      onClick: () => {
        void commands.execute(CommandIDs.snapshot, { notebookId: panel.id });
      }
    });
    button.node.dataset.command = CommandIDs.snapshot;

    const update = () => {
      if (button.isDisposed) {
        return;
      }
      const kernel = actions.kernelOf(panel);
      const managed = !!kernel && actions.managed.isManaged(kernel);
      button.setHidden(!managed);
      button.enabled = managed && !actions.isBusy(kernel?.id);
    };
    if (!panel.toolbar.insertAfter('cellType', 'infinijup-snapshot', button)) {
      panel.toolbar.addItem('infinijup-snapshot', button);
    }
    update();
    panel.sessionContext.kernelChanged.connect(update);
    panel.sessionContext.statusChanged.connect(update);
    actions.managed.changed.connect(update);
    actions.busyChanged.connect(update);

    return new DisposableDelegate(() => {
      panel.sessionContext.kernelChanged.disconnect(update);
      panel.sessionContext.statusChanged.disconnect(update);
      actions.managed.changed.disconnect(update);
      actions.busyChanged.disconnect(update);
      button.dispose();
    });
  }
}

/** The Undo button of the notebook toolbar, after Snapshot, for managed kernels only. */
export class UndoButtonExtension implements DocumentRegistry.IWidgetExtension<
  NotebookPanel,
  INotebookModel
> {
  constructor(
    private readonly _commands: CommandRegistry,
    private readonly _isManaged: (kernel: Kernel.IKernelConnection) => boolean,
    private readonly _managedChanged: ISignal<unknown, unknown>
  ) {}

  createNew(panel: NotebookPanel): IDisposable {
    const button = new ToolbarButton({
      className: 'jp-Infinijup-undoButton',
      icon: undoIcon,
      tooltip:
        'Undo the last cell: the kernel goes back to its state before it (Ctrl+Alt+Z; Redo: Ctrl+Alt+Shift+Z)',
      onClick: () => {
        void this._commands.execute(CommandIDs.undo, { notebookId: panel.id });
      }
    });
    button.node.dataset.command = CommandIDs.undo;
    const update = () => {
      if (button.isDisposed) {
        return;
      }
      const kernel = panel.sessionContext.session?.kernel;
      button.setHidden(!kernel || !this._isManaged(kernel));
    };
    if (
      !panel.toolbar.insertAfter('infinijup-snapshot', 'infinijup-undo', button)
    ) {
      panel.toolbar.addItem('infinijup-undo', button);
    }
    update();
    panel.sessionContext.kernelChanged.connect(update);
    this._managedChanged.connect(update);
    return new DisposableDelegate(() => {
      panel.sessionContext.kernelChanged.disconnect(update);
      this._managedChanged.disconnect(update);
      button.dispose();
    });
  }
}
