/**
 * The "Kernel history" side panel: a toolbar, the state of the notebook's
 * kernel, the commit graph and the details of the selected commit.
 */

import { PathExt } from '@jupyterlab/coreutils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import {
  CommandToolbarButton,
  refreshIcon,
  Toolbar
} from '@jupyterlab/ui-components';
import type { CommandRegistry } from '@lumino/commands';
import { Panel, Widget } from '@lumino/widgets';

import type { InfinijupActions } from './actions';
import { CommandIDs } from './commandids';
import {
  formatAge,
  formatBytes,
  formatDate,
  formatSeconds,
  hasGpu,
  shortId
} from './format';
import { esc, GraphView } from './graphview';
import { historyIcon } from './icons';
import type { HistoryModel } from './model';
import { PHASE_LABELS } from './types';

export class HistoryPanel extends Panel {
  constructor(options: HistoryPanel.IOptions) {
    super();
    this.id = 'infinijup-history';
    this.addClass('jp-Infinijup-history');
    this.title.icon = historyIcon;
    this.title.caption = 'Kernel history';
    this.model = options.model;
    this._actions = options.actions;
    this._commands = options.commands;

    const header = new Widget();
    header.addClass('jp-Infinijup-header');
    header.node.innerHTML =
      '<h2 class="jp-Infinijup-title">Kernel history</h2><div class="jp-Infinijup-notebook"></div>';
    this._notebookLabel = header.node.querySelector('.jp-Infinijup-notebook')!;
    this.addWidget(header);

    const toolbar = new Toolbar();
    toolbar.addClass('jp-Infinijup-toolbar');
    toolbar.addItem(
      'snapshot',
      new CommandToolbarButton({
        commands: this._commands,
        id: CommandIDs.snapshot,
        label: 'Snapshot'
      })
    );
    toolbar.addItem('spacer', Toolbar.createSpacerItem());
    toolbar.addItem(
      'collapse',
      new CommandToolbarButton({
        commands: this._commands,
        id: CommandIDs.toggleCollapse,
        label: 'Collapse'
      })
    );
    toolbar.addItem(
      'refresh',
      new CommandToolbarButton({
        commands: this._commands,
        id: CommandIDs.refresh,
        icon: refreshIcon,
        label: ''
      })
    );
    this.addWidget(toolbar);

    this._status = new Widget();
    this._status.addClass('jp-Infinijup-status');
    this.addWidget(this._status);

    this.graph = new GraphView(this.model);
    this.addWidget(this.graph);

    this._details = new Widget();
    this._details.addClass('jp-Infinijup-details');
    this._details.node.addEventListener('click', this._onDetailsClick);
    this.addWidget(this._details);

    this.model.changed.connect(this._onModelChanged, this);
    this._actions.managed.changed.connect(this._renderStatus, this);
    this._actions.busyChanged.connect(this._renderStatus, this);
    this._renderAll();
  }

  readonly model: HistoryModel;
  readonly graph: GraphView;

  /** The notebook whose history is shown. */
  get notebook(): NotebookPanel | null {
    return this._notebook;
  }

  /** Follow another notebook (or none). */
  setNotebook(panel: NotebookPanel | null): void {
    if (panel === this._notebook) {
      return;
    }
    if (this._notebook) {
      this._notebook.sessionContext.kernelChanged.disconnect(
        this._updateTarget,
        this
      );
      this._notebook.sessionContext.statusChanged.disconnect(
        this._renderStatus,
        this
      );
      this._notebook.context.pathChanged.disconnect(this._updateTarget, this);
      this._notebook.disposed.disconnect(this._onNotebookDisposed, this);
    }
    this._notebook = panel;
    if (panel) {
      panel.sessionContext.kernelChanged.connect(this._updateTarget, this);
      panel.sessionContext.statusChanged.connect(this._renderStatus, this);
      panel.sessionContext.propertyChanged.connect(this._updateTarget, this);
      panel.context.pathChanged.connect(this._updateTarget, this);
      panel.disposed.connect(this._onNotebookDisposed, this);
    }
    this._updateTarget();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this.setNotebook(null);
    this._details.node.removeEventListener('click', this._onDetailsClick);
    super.dispose();
  }

  private _onNotebookDisposed(): void {
    this.setNotebook(null);
  }

  private _updateTarget(): void {
    const panel = this._notebook;
    if (!panel) {
      this.model.setTarget(null);
    } else {
      // History belongs to the kernel's session path on the server: after a
      // rename, use the new path once the server's session has it (the
      // session's propertyChanged), not as soon as the document moved.
      const session = panel.sessionContext.session;
      this.model.setTarget({
        path: session?.path ?? panel.context.path,
        kernelId: session?.kernel?.id ?? null
      });
    }
    this._renderAll();
  }

  private _onModelChanged(
    _: HistoryModel,
    kind: HistoryModel.ChangeKind
  ): void {
    switch (kind) {
      case 'selection':
        this._renderDetails();
        break;
      case 'operation':
      case 'state':
        this._renderStatus();
        break;
      default:
        this._renderAll();
    }
    this._commands.notifyCommandChanged();
  }

  private _renderAll(): void {
    const panel = this._notebook;
    this._notebookLabel.textContent = panel
      ? PathExt.basename(panel.context.path)
      : '';
    this._notebookLabel.title = panel ? panel.context.path : '';
    this._renderStatus();
    this._renderDetails();
  }

  /** The notice / head / operation lines above the graph. */
  private _renderStatus(): void {
    const model = this.model;
    const panel = this._notebook;
    const parts: string[] = [];
    const kernel = panel?.sessionContext.session?.kernel ?? null;
    this.node.dataset.state = model.state;

    if (!panel) {
      parts.push(
        '<p class="jp-Infinijup-notice">Open a notebook to see the history of its kernel.</p>'
      );
    } else if (!kernel) {
      parts.push(
        '<p class="jp-Infinijup-notice">This notebook has no kernel running. Start <b>Python 3 (Infinijup)</b> to take snapshots.</p>'
      );
    } else if (!this._actions.managed.isManaged(kernel)) {
      parts.push(
        '<p class="jp-Infinijup-notice">This kernel is not managed by Infinijup, so it cannot be snapshotted. Choose <b>Python 3 (Infinijup)</b> with Kernel › Change Kernel….</p>'
      );
    }

    const op = model.operation;
    if (op) {
      const label = op.op === 'snapshot' ? 'Snapshot' : 'Restore';
      parts.push(
        `<div class="jp-Infinijup-operation" data-phase="${esc(op.phase)}">` +
          `<span>${label}: ${esc(PHASE_LABELS[op.phase] ?? op.phase)}</span>` +
          `<progress max="100" value="${Math.round(op.percent)}"></progress></div>`
      );
    }

    if (model.state === 'error' && model.error) {
      parts.push(
        `<div class="jp-Infinijup-error" role="alert">Could not load the history: ${esc(
          model.error.message
        )} <code>${esc(model.error.reason)}</code> ` +
          '<button class="jp-Button jp-mod-styled jp-mod-reject jp-Infinijup-retry">Retry</button></div>'
      );
    } else if (model.state === 'loading' && !model.history) {
      parts.push('<p class="jp-Infinijup-notice">Loading…</p>');
    } else if (model.state === 'ready') {
      const head = model.head;
      const n = model.commits.length;
      if (n === 0) {
        parts.push(
          '<p class="jp-Infinijup-notice jp-Infinijup-empty">No snapshots yet. Press <b>Snapshot</b> (Ctrl+Alt+S) or run <code>%snapshot</code> in a cell.</p>'
        );
      } else {
        const threads = Object.keys(model.threads).length;
        const hidden = model.layout.hiddenCount;
        parts.push(
          `<div class="jp-Infinijup-summary"><span class="jp-Infinijup-headline">` +
            (head?.commit
              ? `HEAD <code>${shortId(head.commit)}</code>`
              : 'HEAD none') +
            ` · next snapshot on <b>${esc(head?.thread || 'main')}</b></span>` +
            `<span class="jp-Infinijup-counts">${n} commit${n === 1 ? '' : 's'} · ${threads} thread${
              threads === 1 ? '' : 's'
            }${hidden ? ` · ${hidden} collapsed` : ''}</span></div>`
        );
      }
    }
    this._status.node.innerHTML = parts.join('');
    const retry = this._status.node.querySelector('.jp-Infinijup-retry');
    if (retry) {
      retry.addEventListener('click', () => void this.model.refresh());
    }
    this._commands.notifyCommandChanged();
  }

  /** The details of the selected commit. */
  private _renderDetails(): void {
    const model = this.model;
    const commit = model.getCommit(model.selected);
    const node = this._details.node;
    if (!commit) {
      node.innerHTML = '';
      node.classList.add('lm-mod-hidden');
      return;
    }
    node.classList.remove('lm-mod-hidden');
    const isHead = model.head?.commit === commit.id;
    const tips = model.tips.get(commit.id) ?? [];
    const s = commit.stats;
    const row = (k: string, v: string) => `<tr><th>${k}</th><td>${v}</td></tr>`;
    const parents = commit.parents.length
      ? commit.parents
          .map(
            p =>
              `<a href="#" class="jp-Infinijup-parent" data-commit-id="${esc(p)}"><code>${shortId(
                p
              )}</code></a>`
          )
          .join(' ')
      : 'none (first snapshot)';
    let metadata = '';
    try {
      metadata = JSON.stringify(commit.metadata, null, 2);
    } catch {
      metadata = String(commit.metadata);
    }
    node.innerHTML =
      `<div class="jp-Infinijup-details-title">${esc(commit.message || '(no message)')}</div>` +
      '<table class="jp-Infinijup-details-table"><tbody>' +
      row('Id', `<code class="jp-Infinijup-fullid">${esc(commit.id)}</code>`) +
      row(
        'Thread',
        `${esc(commit.thread)}${tips.length ? ` (tip of ${tips.map(esc).join(', ')})` : ''}${
          isHead ? ' · <b>HEAD</b>' : ''
        }`
      ) +
      row('Parents', parents) +
      row(
        'Created',
        `${esc(formatDate(commit.created))} (${formatAge(commit.created)})`
      ) +
      row('Image', formatBytes(s.image_bytes)) +
      row('Stored', `${formatBytes(s.stored_bytes)} new in the store`) +
      row('Paused', formatSeconds(s.pause_s)) +
      (s.duration_s ? row('Duration', formatSeconds(s.duration_s)) : '') +
      row(
        'GPU state',
        hasGpu(commit) ? `yes, ${formatBytes(s.gpu_bytes ?? 0)}` : 'no'
      ) +
      '</tbody></table>' +
      `<details class="jp-Infinijup-metadata"><summary>Metadata</summary><pre>${esc(
        metadata
      )}</pre></details>` +
      '<div class="jp-Infinijup-actions">' +
      `<button class="jp-Button jp-mod-styled jp-mod-accept" data-action="restore" title="Replace the running kernel with this snapshot">Restore</button>` +
      `<button class="jp-Button jp-mod-styled" data-action="branch" title="Restore this snapshot into a new thread">Branch from here</button>` +
      `<button class="jp-Button jp-mod-styled" data-action="copy" title="Copy the full commit id">Copy id</button>` +
      '</div>';
    const enabled = this._actions.canOperate(this._notebook);
    node
      .querySelectorAll<HTMLButtonElement>(
        '[data-action="restore"],[data-action="branch"]'
      )
      .forEach(b => (b.disabled = !enabled));
  }

  private _onDetailsClick = (event: MouseEvent) => {
    const target = event.target as HTMLElement;
    const commit = this.model.selected;
    const button = target.closest<HTMLElement>('[data-action]');
    if (button && commit) {
      const notebookId = this._notebook?.id;
      switch (button.dataset.action) {
        case 'restore':
          void this._commands.execute(CommandIDs.restore, {
            commit,
            notebookId
          });
          break;
        case 'branch':
          void this._commands.execute(CommandIDs.branch, {
            commit,
            notebookId
          });
          break;
        case 'copy':
          void this._commands.execute(CommandIDs.copyId, { commit });
          break;
      }
      return;
    }
    const parent = target.closest<HTMLElement>('.jp-Infinijup-parent');
    if (parent?.dataset.commitId) {
      event.preventDefault();
      const id = parent.dataset.commitId;
      const row = this.model.reveal(id);
      if (row !== undefined) {
        this.model.select(id);
        this.graph.scrollToRow(row);
      }
    }
  };

  private _actions: InfinijupActions;
  private _commands: CommandRegistry;
  private _notebook: NotebookPanel | null = null;
  private _notebookLabel: HTMLElement;
  private _status: Widget;
  private _details: Widget;
}

export namespace HistoryPanel {
  export interface IOptions {
    model: HistoryModel;
    actions: InfinijupActions;
    commands: CommandRegistry;
  }
}
