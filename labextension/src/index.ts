/**
 * Infinijup for JupyterLab: Snapshot button, history graph panel, restore and
 * branch with progress notifications.
 */

import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import {
  Dialog,
  ICommandPalette,
  Notification,
  showDialog
} from '@jupyterlab/apputils';
import { PathExt } from '@jupyterlab/coreutils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import type { ReadonlyPartialJSONObject } from '@lumino/coreutils';

import {
  DEFAULT_SETTINGS,
  IInfinijupSettings,
  InfinijupActions,
  sessionPath
} from './actions';
import { SnapshotButtonExtension, UndoButtonExtension } from './button';
import { CommandIDs } from './commandids';
import { asRequestError } from './errors';
import { shortId } from './format';
import { GpuIndicator } from './gpuStatus';
import { HeadToolbarExtension } from './headLabel';
import { branchIcon, historyIcon, restoreIcon, snapshotIcon } from './icons';
import { ManagedKernels } from './kernels';
import { HistoryModel } from './model';
import { CHANGE_KERNEL_COMMAND, HistoryPanel } from './panel';
import { INotifier, INotifyOptions, ProgressTracker } from './progress';
import { InfinijupClient } from './request';
import { RestActions } from './restActions';
import { RestStates } from './restState';
import { RestClient, RestIndicator, RestToolbarExtension } from './restStatus';
import { parseOperationEvent } from './types';
import { UndoActions, UndoClient } from './undo';

export { CommandIDs } from './commandids';
export * from './types';
export { layoutGraph } from './layout';
export { HistoryModel } from './model';
export { InfinijupClient, InfinijupRequestError, requestAPI } from './request';

const PLUGIN_ID = 'infinijup:plugin';
const CATEGORY = 'Infinijup';

/** Notification options for JupyterLab: error details become an action. */
function jlOptions(options: INotifyOptions = {}) {
  const { details, cancel, ...rest } = options;
  if (cancel) {
    return {
      ...rest,
      actions: [
        {
          label: 'Cancel',
          caption: 'Stop waiting for the running cell (it goes on)',
          callback: cancel
        }
      ]
    };
  }
  if (!details) {
    return { ...rest, actions: [] };
  }
  return {
    ...rest,
    actions: [
      {
        label: 'Details',
        caption: 'Show the whole error',
        callback: () => {
          void showDialog({
            title: details.title,
            body: details.reason
              ? `${details.message}\n\nReason: ${details.reason}`
              : details.message,
            buttons: [Dialog.okButton()]
          });
        }
      }
    ]
  };
}

/** JupyterLab's Notification API as the tracker's notifier. */
const notifier: INotifier = {
  emit: (message, type, options) =>
    Notification.emit(message, type, jlOptions(options)),
  update: ({ id, message, type, ...options }) =>
    Notification.update({ id, message, type, ...jlOptions(options) }),
  dismiss: id => Notification.dismiss(id)
};

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'Snapshot, restore and branch whole running kernels (Infinijup), with a history graph.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ISettingRegistry, ICommandPalette, ILayoutRestorer, IStatusBar],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    settingRegistry: ISettingRegistry | null,
    palette: ICommandPalette | null,
    restorer: ILayoutRestorer | null,
    statusBar: IStatusBar | null
  ) => {
    const { commands, serviceManager, shell } = app;
    const api = new InfinijupClient(serviceManager.serverSettings);
    const managed = new ManagedKernels(api);
    let settings: IInfinijupSettings = { ...DEFAULT_SETTINGS };
    let settingsObject: ISettingRegistry.ISettings | null = null;

    const model = new HistoryModel({
      api,
      collapse: settings.collapseRuns,
      minRun: settings.collapseMinRun
    });

    const kernelOfEvent = (kernelId: string, path: string) =>
      tracker.find(
        p =>
          p.sessionContext.session?.kernel?.id === kernelId ||
          (!!path && sessionPath(p) === path)
      );
    const cancelClient = new RestClient(serviceManager.serverSettings);
    const progress = new ProgressTracker({
      notifier,
      onCancel: kernelId => {
        cancelClient.cancel(kernelId).catch(error => {
          Notification.error(
            `Could not cancel: ${asRequestError(error).message}`,
            { autoClose: 5000 }
          );
        });
      },
      // Automatic snapshots and the steps of an undo make no notification:
      // the undo says where it went, an automatic snapshot says nothing.
      isRelevant: ev => !ev.quiet && !!kernelOfEvent(ev.kernel_id, ev.path),
      describe: ev => {
        const panel = kernelOfEvent(ev.kernel_id, ev.path);
        return PathExt.basename(panel?.context.path || ev.path || ev.kernel_id);
      }
    });

    const actions = new InfinijupActions({
      api,
      tracker,
      managed,
      progress,
      model,
      settings: () => settings,
      setSetting: async (key, value) => {
        await settingsObject?.set(key, value);
      },
      openNotebook: async (path, kernelId) => {
        // The server started the kernel without a session (resume with
        // session: false): opening the notebook on it makes the one session.
        await commands.execute('docmanager:open', {
          path,
          factory: 'Notebook',
          kernel: { id: kernelId }
        });
      },
      changeKernel: notebook => {
        shell.activateById(notebook.id);
        void commands.execute(CHANGE_KERNEL_COMMAND);
      }
    });

    // Hibernation (issue 14): the kernels' rest states.
    const restStates = new RestStates(
      new RestClient(serviceManager.serverSettings)
    );
    const restActions = new RestActions(restStates, notifier);
    const restTarget = (args: ReadonlyPartialJSONObject) => {
      const notebook = actions.notebook(args.notebookId);
      const kernel = actions.kernelOf(notebook);
      return notebook
        ? {
            name: PathExt.basename(notebook.context.path),
            kernel,
            managed: !!kernel && managed.isManaged(kernel)
          }
        : null;
    };
    const restOptions = {
      states: restStates,
      onWake: (notebook: NotebookPanel, kernelId: string) => {
        void restActions.wake(
          PathExt.basename(notebook.context.path),
          kernelId
        );
      }
    };

    // Which snapshot each notebook's kernel is in, in its toolbar.
    const heads = new HeadToolbarExtension({
      api: cancelClient,
      onOpen: () => void commands.execute(CommandIDs.showHistory)
    });

    // Live updates: snapshots from %snapshot, other tabs, progress phases.
    const events = serviceManager.events;
    if (events) {
      events.stream.connect((_, emission) => {
        restStates.handleEmission(emission);
        const event = parseOperationEvent(emission);
        if (!event) {
          return;
        }
        actions.handleEvent(event);
        heads.handleEvent(event);
        model.handleEvent(event);
        progress.handleEvent(event);
      });
    } else {
      console.warn(
        'Infinijup: no event manager; history updates need a refresh'
      );
    }

    // The panel.
    const panel = new HistoryPanel({ model, actions, commands });
    const restBanner = new RestIndicator({
      ...restOptions,
      className: 'jp-Infinijup-rest-banner'
    });
    panel.insertWidget(1, restBanner);
    shell.add(panel, 'right', { rank: 650, type: 'Kernel History' });
    if (restorer) {
      restorer.add(panel, 'infinijup-history');
    }
    const follow = () => {
      panel.setNotebook(tracker.currentWidget);
      restBanner.setNotebook(tracker.currentWidget);
      restStatusItem?.setNotebook(tracker.currentWidget);
      commands.notifyCommandChanged();
    };
    const restStatusItem = statusBar
      ? new RestIndicator({
          ...restOptions,
          className: 'jp-Infinijup-rest-statusbar'
        })
      : null;
    if (statusBar) {
      const gpuItem = new GpuIndicator(serviceManager.serverSettings);
      statusBar.registerStatusItem('infinijup:gpu', {
        item: gpuItem,
        align: 'left',
        rank: 3,
        isActive: () => gpuItem.isActive,
        activeStateChanged: gpuItem.activeChanged
      });
    }
    if (statusBar && restStatusItem) {
      statusBar.registerStatusItem('infinijup:rest-state', {
        item: restStatusItem,
        align: 'left',
        rank: 2,
        isActive: () => restStatusItem.isResting,
        activeStateChanged: restStatusItem.restingChanged
      });
    }
    tracker.currentChanged.connect(follow);
    follow();
    // A restart gives the kernel a fresh state under the same id: once it
    // answers again, the history reloads (its head is no snapshot now).
    const restarting = new WeakSet<NotebookPanel>();
    tracker.widgetAdded.connect((_, notebook) => {
      notebook.sessionContext.statusChanged.connect((_ctx, status) => {
        if (status === 'restarting' || status === 'autorestarting') {
          restarting.add(notebook);
        } else if (status === 'idle' && restarting.delete(notebook)) {
          if (tracker.currentWidget === notebook) {
            model.scheduleRefresh();
          }
        }
      });
    });

    // The toolbar button.
    app.docRegistry.addWidgetExtension(
      'Notebook',
      new SnapshotButtonExtension(commands, actions)
    );
    app.docRegistry.addWidgetExtension(
      'Notebook',
      new RestToolbarExtension(restOptions)
    );
    app.docRegistry.addWidgetExtension('Notebook', heads);

    const refreshCommands = () => commands.notifyCommandChanged();
    managed.changed.connect(refreshCommands);
    restStates.changed.connect(refreshCommands);
    actions.busyChanged.connect(refreshCommands);

    /** The commit a command acts on. */
    const commitArg = (args: ReadonlyPartialJSONObject): string | undefined => {
      if (typeof args.commit === 'string' && args.commit) {
        return args.commit;
      }
      if (args.fromContextMenu) {
        const row = app.contextMenuHitTest(node => !!node.dataset?.commitId);
        return row?.dataset.commitId ?? model.selected ?? undefined;
      }
      return undefined;
    };

    // Enabled whenever there is a notebook that is not busy: on a kernel that
    // cannot be snapshotted the command says why (a disabled command would
    // ignore the shortcut silently).
    const usable = (args: ReadonlyPartialJSONObject) => {
      const notebook = actions.notebook(args.notebookId);
      return !!notebook && actions.canResume(notebook);
    };

    commands.addCommand(CommandIDs.snapshot, {
      label: 'Snapshot Kernel',
      caption: 'Save the whole state of the kernel (memory, GPU) as a commit',
      icon: args => (args.isPalette ? undefined : snapshotIcon),
      isEnabled: usable,
      execute: async args => {
        const message =
          typeof args.message === 'string' ? args.message : undefined;
        return actions.snapshot(actions.notebook(args.notebookId), { message });
      }
    });

    commands.addCommand(CommandIDs.restore, {
      label: args => {
        const commit = commitArg(args);
        return commit
          ? `Restore ${shortId(commit)}`
          : 'Restore Kernel Snapshot…';
      },
      caption: 'Replace the running kernel with a snapshot',
      icon: args => (args.isPalette ? undefined : restoreIcon),
      isEnabled: usable,
      execute: args =>
        actions.restore(actions.notebook(args.notebookId), commitArg(args))
    });

    commands.addCommand(CommandIDs.branch, {
      label: args =>
        commitArg(args) ? 'Branch from Here…' : 'Branch from Kernel Snapshot…',
      caption: 'Restore a snapshot into a new thread',
      icon: args => (args.isPalette ? undefined : branchIcon),
      isEnabled: usable,
      execute: args =>
        actions.branch(
          actions.notebook(args.notebookId),
          commitArg(args),
          typeof args.thread === 'string' ? args.thread : undefined
        )
    });

    commands.addCommand(CommandIDs.resume, {
      label: args =>
        commitArg(args) ? 'Resume Here' : 'Resume Kernel Snapshot…',
      caption:
        'Start a kernel for this notebook from a snapshot (when it has no Infinijup kernel)',
      icon: args => (args.isPalette ? undefined : restoreIcon),
      isEnabled: usable,
      execute: args =>
        actions.resume(actions.notebook(args.notebookId), commitArg(args))
    });

    commands.addCommand(CommandIDs.openInNewNotebook, {
      label: args =>
        commitArg(args)
          ? 'Open in New Notebook'
          : 'Open Kernel Snapshot in New Notebook…',
      caption:
        'Copy the notebook and resume a snapshot in its own new kernel, next to this one',
      isEnabled: usable,
      execute: args =>
        actions.resume(actions.notebook(args.notebookId), commitArg(args), {
          newNotebook: true
        })
    });

    commands.addCommand(CommandIDs.copyId, {
      label: 'Copy Snapshot Id',
      caption: 'Copy the full commit id to the clipboard',
      isEnabled: args => !!(commitArg(args) ?? model.selected),
      execute: args => {
        const id = commitArg(args) ?? model.selected;
        if (id) {
          actions.copyId(id);
        }
      }
    });

    commands.addCommand(CommandIDs.showHistory, {
      label: 'Show Kernel History',
      caption: 'Show the snapshot history of the current notebook',
      icon: args => (args.isPalette ? undefined : historyIcon),
      execute: () => {
        shell.activateById(panel.id);
      }
    });

    commands.addCommand(CommandIDs.refresh, {
      label: 'Refresh Kernel History',
      caption: 'Reload the snapshot history',
      isEnabled: () => !!model.target,
      execute: () => model.refresh()
    });

    commands.addCommand(CommandIDs.toggleCollapse, {
      label: args =>
        args.isPalette ? 'Fold Long Runs in Kernel History' : 'Fold runs',
      caption: 'Fold long linear runs of commits in the history graph',
      isToggled: () => model.collapse,
      execute: () => {
        model.collapse = !model.collapse;
        if (model.collapse) {
          model.collapseAll();
        }
        commands.notifyCommandChanged(CommandIDs.toggleCollapse);
      }
    });

    commands.addCommand(CommandIDs.hibernate, {
      label: 'Hibernate Kernel',
      caption:
        'Save the kernel to a snapshot and end its process (no memory, no GPU); the next cell wakes it',
      // Enabled on any notebook: on one that cannot hibernate, it says why.
      isEnabled: args => {
        const target = restTarget(args);
        return (
          !!target &&
          (!target.kernel ||
            !target.managed ||
            restActions.canHibernate(target))
        );
      },
      execute: args => restActions.hibernate(restTarget(args))
    });

    // Undo and redo of cells (issue 30).
    const undoClient = new UndoClient(serviceManager.serverSettings);
    const undoActions = new UndoActions(undoClient, notifier);
    const undoTarget = (args: ReadonlyPartialJSONObject) => {
      const notebook = actions.notebook(args.notebookId);
      const kernel = actions.kernelOf(notebook);
      return notebook && kernel && managed.isManaged(kernel)
        ? {
            kernelId: kernel.id,
            label: PathExt.basename(notebook.context.path)
          }
        : null;
    };
    const moves = [
      [
        CommandIDs.undo,
        'undo',
        'Undo Last Cell',
        'Bring the kernel back to its state before the last cell that changed it (Redo returns)'
      ],
      [
        CommandIDs.redo,
        'redo',
        'Redo Cell',
        'Return to where the last Undo left'
      ]
    ] as const;
    for (const [id, what, label, caption] of moves) {
      commands.addCommand(id, {
        label,
        caption,
        isEnabled: args => {
          const t = undoTarget(args);
          return !!t && !undoActions.isBusy(t.kernelId);
        },
        execute: async args => {
          const t = undoTarget(args);
          if (t) {
            await undoActions[what](t.kernelId, t.label);
            model.scheduleRefresh();
          }
        }
      });
    }
    undoActions.changed.connect(refreshCommands);
    app.docRegistry.addWidgetExtension(
      'Notebook',
      new UndoButtonExtension(
        commands,
        kernel => managed.isManaged(kernel),
        managed.changed
      )
    );
    // The setting "Automatic snapshots": each managed kernel is told once it is known.
    const autosnapshotTold = new Set<string>();
    const tellAutosnapshot = (force = false) => {
      if (settings.autosnapshot === 'server') {
        return;
      }
      const on = settings.autosnapshot === 'on';
      tracker.forEach(panel => {
        const kernel = actions.kernelOf(panel);
        if (!kernel || !managed.isManaged(kernel)) {
          return;
        }
        if (!force && autosnapshotTold.has(kernel.id)) {
          return;
        }
        autosnapshotTold.add(kernel.id);
        undoClient.autosnapshot(kernel.id, on).catch(reason => {
          console.warn('Infinijup: automatic snapshots not set', reason);
        });
      });
    };
    managed.changed.connect(() => tellAutosnapshot());

    if (palette) {
      for (const command of [
        CommandIDs.undo,
        CommandIDs.redo,
        CommandIDs.hibernate,
        CommandIDs.snapshot,
        CommandIDs.restore,
        CommandIDs.branch,
        CommandIDs.resume,
        CommandIDs.openInNewNotebook,
        CommandIDs.showHistory,
        CommandIDs.refresh,
        CommandIDs.toggleCollapse
      ]) {
        palette.addItem({
          command,
          category: CATEGORY,
          args: { isPalette: true }
        });
      }
    }

    // Settings.
    const applySettings = (s: ISettingRegistry.ISettings) => {
      settings = { ...DEFAULT_SETTINGS, ...(s.composite as any) };
      model.collapse = settings.collapseRuns;
      model.minRun = settings.collapseMinRun;
      tellAutosnapshot(true);
    };
    if (settingRegistry) {
      settingRegistry
        .load(PLUGIN_ID)
        .then(s => {
          settingsObject = s;
          applySettings(s);
          s.changed.connect(applySettings);
        })
        .catch(reason => {
          console.error('Infinijup: failed to load settings.', reason);
        });
    }
  }
};

export default plugin;
