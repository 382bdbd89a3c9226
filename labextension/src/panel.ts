/**
 * The "Kernel history" side panel: a toolbar, a search field, the state of
 * the notebook's kernel (where the next snapshot goes), the selected commit's
 * card (actions, changed variables, comparison) and the commit graph.
 *
 * The card sits above the graph, so notifications (bottom right) never cover
 * its buttons.
 */

import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
import { PathExt } from '@jupyterlab/coreutils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import {
  CommandToolbarButton,
  refreshIcon,
  Toolbar
} from '@jupyterlab/ui-components';
import type { CommandRegistry } from '@lumino/commands';
import type { IDisposable } from '@lumino/disposable';
import { Panel, Widget } from '@lumino/widgets';

import type { InfinijupActions } from './actions';
import { CommandIDs } from './commandids';
import {
  cellLabel,
  commitTitle,
  compareCommits,
  removedVariables,
  sidecarsOf,
  variablesOf
} from './commits';
import {
  describeVariable,
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
import type { INotifier } from './progress';
import { InfinijupClient } from './request';
import { Confirm, spaceLine, SpaceActions } from './restActions';
import { TimelineView } from './timelineView';
import { ICommit, IVariableInfo, PHASE_LABELS } from './types';

/** JupyterLab's command that opens the kernel selector of a notebook. */
export const CHANGE_KERNEL_COMMAND = 'notebook:change-kernel';

/** The panel's own commands (its rows' context menu: labextension/schema/plugin.json). */
export const DELETE_SNAPSHOT_COMMAND = 'infinijup:delete-snapshot';
export const DELETE_THREAD_COMMAND = 'infinijup:delete-thread';

const OP_NAMES = { snapshot: 'Snapshot', restore: 'Restore', resume: 'Resume' };

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
      '<h2 class="jp-Infinijup-title">Kernel history</h2><div class="jp-Infinijup-notebook"></div>' +
      '<div class="jp-Infinijup-space" title="What the snapshot store takes on disk, and the hot tier: recent snapshots kept uncompressed for fast restores"></div>';
    this._notebookLabel = header.node.querySelector('.jp-Infinijup-notebook')!;
    this._spaceLabel = header.node.querySelector('.jp-Infinijup-space')!;
    this._space =
      options.space ??
      new SpaceActions(new InfinijupClient(), labNotifier, labConfirm);
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
    this._fold = new Widget();
    this._fold.addClass('jp-Infinijup-fold');
    this._fold.node.innerHTML =
      '<label title="Fold long runs of commits (one parent, one child) into one row"><input type="checkbox"> Fold runs</label>';
    this._foldInput = this._fold.node.querySelector('input')!;
    this._foldInput.addEventListener('change', () => {
      if (this._foldInput.checked !== this.model.collapse) {
        void this._commands.execute(CommandIDs.toggleCollapse);
      }
    });
    toolbar.addItem('collapse', this._fold);
    this._cellsToggle = new Widget();
    this._cellsToggle.addClass('jp-Infinijup-cells-toggle');
    this._cellsToggle.node.innerHTML =
      '<label title="One row per cell along the kernel\'s path (automatic snapshots folded), instead of the graph of every thread"><input type="checkbox"> Cells</label>';
    this._cellsInput = this._cellsToggle.node.querySelector('input')!;
    this._cellsInput.addEventListener('change', () =>
      this.showCells(this._cellsInput.checked)
    );
    toolbar.addItem('cells', this._cellsToggle);
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

    this._search = new Widget();
    this._search.addClass('jp-Infinijup-search');
    this._search.node.innerHTML =
      '<input type="search" class="jp-mod-styled" placeholder="Search: message, cell, variable" aria-label="Search snapshots" spellcheck="false"><span class="jp-Infinijup-search-count" aria-live="polite"></span>';
    this._searchInput = this._search.node.querySelector('input')!;
    this._searchCount = this._search.node.querySelector(
      '.jp-Infinijup-search-count'
    )!;
    this._searchInput.addEventListener('input', () => {
      this.model.query = this._searchInput.value;
    });
    this._searchInput.addEventListener('keydown', this._onSearchKey);
    this.addWidget(this._search);

    this._status = new Widget();
    this._status.addClass('jp-Infinijup-status');
    this._status.node.addEventListener('click', this._onStatusClick);
    this.addWidget(this._status);

    this._details = new Widget();
    this._details.addClass('jp-Infinijup-details');
    this._details.node.addEventListener('click', this._onDetailsClick);
    this.addWidget(this._details);

    this.graph = new GraphView(this.model);
    this.addWidget(this.graph);
    // The row a context menu opened on (its commands act on that snapshot).
    this.graph.node.addEventListener('contextmenu', this._onContextMenu, true);
    this.timeline = new TimelineView(this.model);
    this.timeline.hide();
    this.addWidget(this.timeline);
    this.timeline.node.addEventListener(
      'contextmenu',
      this._onContextMenu,
      true
    );
    this._commandsAdded = this._addCommands();

    this.model.changed.connect(this._onModelChanged, this);
    this._actions.managed.changed.connect(this._renderAll, this);
    this._actions.busyChanged.connect(this._renderAll, this);
    this._renderAll();
  }

  readonly model: HistoryModel;
  readonly graph: GraphView;
  /** The per-cell timeline, shown in place of the graph by "Cells". */
  readonly timeline: TimelineView;

  /** Whether the per-cell timeline is shown (else the graph). */
  get cellsShown(): boolean {
    return !this.timeline.isHidden;
  }

  /** Show the per-cell timeline (true) or the graph (false). */
  showCells(on: boolean): void {
    this._cellsInput.checked = on;
    this._foldInput.disabled = on;
    if (on) {
      this.graph.hide();
      this.timeline.show();
      this.timeline.render();
    } else {
      this.timeline.hide();
      this.graph.show();
    }
  }

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
      const old = this._notebook;
      old.sessionContext.kernelChanged.disconnect(this._updateTarget, this);
      old.sessionContext.statusChanged.disconnect(this._renderStatus, this);
      old.sessionContext.propertyChanged.disconnect(this._updateTarget, this);
      old.context.pathChanged.disconnect(this._updateTarget, this);
      old.disposed.disconnect(this._onNotebookDisposed, this);
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
    for (const command of this._commandsAdded) {
      command.dispose();
    }
    this.graph.node.removeEventListener(
      'contextmenu',
      this._onContextMenu,
      true
    );
    this._details.node.removeEventListener('click', this._onDetailsClick);
    this._status.node.removeEventListener('click', this._onStatusClick);
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
        this._renderStatus();
        this._renderDetails();
        break;
      case 'operation':
      case 'state':
        this._renderStatus();
        break;
      case 'history':
        this._renderAll();
        void this.refreshSpace();
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
    this._foldInput.checked = this.model.collapse;
    this._renderSearch();
    this._renderStatus();
    this._renderDetails();
  }

  private _renderSearch(): void {
    if (this._searchInput.value !== this.model.query) {
      this._searchInput.value = this.model.query;
    }
    const matches = this.model.matches;
    this._searchCount.textContent = matches
      ? matches.length
        ? `${matches.length} of ${this.model.commits.length}`
        : 'no match'
      : '';
    this._search.node.classList.toggle(
      'lm-mod-hidden',
      this.model.commits.length === 0 && !this.model.query
    );
  }

  /** The notice / head / operation lines above the graph. */
  private _renderStatus(): void {
    const model = this.model;
    const panel = this._notebook;
    const parts: string[] = [];
    const kernel = panel?.sessionContext.session?.kernel ?? null;
    const managed = !!kernel && this._actions.managed.isManaged(kernel);
    const ready = model.state === 'ready';
    const n = model.commits.length;
    this.node.dataset.state = model.state;
    this.node.dataset.kernel = !panel
      ? 'none'
      : !kernel
        ? 'none'
        : managed
          ? 'managed'
          : 'unmanaged';

    if (!panel) {
      parts.push(
        '<p class="jp-Infinijup-notice">Open a notebook to see the history of its kernel.</p>'
      );
    } else if (!kernel) {
      parts.push(
        ready && n > 0
          ? '<p class="jp-Infinijup-notice jp-Infinijup-nokernel">No kernel is running. Select a snapshot and press <b>Resume here</b> to start a kernel from it, or <b>Open in new notebook</b>.</p>'
          : '<p class="jp-Infinijup-notice jp-Infinijup-nokernel">This notebook has no kernel running. Start <b>Python 3 (Infinijup)</b> to take snapshots.</p>'
      );
    } else if (!managed) {
      const change = this._commands.hasCommand(CHANGE_KERNEL_COMMAND)
        ? ' <button class="jp-Button jp-mod-styled jp-Infinijup-change-kernel">Change Kernel…</button>'
        : '';
      parts.push(
        `<div class="jp-Infinijup-notice jp-Infinijup-unmanaged">This kernel (${esc(
          panel.sessionContext.kernelDisplayName
        )}) is not managed by Infinijup, so it cannot be snapshotted. To take snapshots, switch this notebook to <b>Python 3 (Infinijup)</b> (Kernel › Change Kernel…).${change}` +
          (ready && n > 0
            ? ' Earlier snapshots of this notebook are below: <b>Resume here</b> replaces this kernel with one of them.'
            : '') +
          '</div>'
      );
    }

    const op = model.operation;
    if (op) {
      parts.push(
        `<div class="jp-Infinijup-operation" data-phase="${esc(op.phase)}">` +
          `<span>${OP_NAMES[op.op] ?? op.op}: ${esc(PHASE_LABELS[op.phase] ?? op.phase)}</span>` +
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
    } else if (ready) {
      if (n === 0) {
        if (managed) {
          parts.push(
            '<p class="jp-Infinijup-notice jp-Infinijup-empty">No snapshots yet. Press <b>Snapshot</b> (Ctrl+Alt+S) or run <code>%snapshot</code> in a cell.</p>'
          );
        }
      } else {
        const threads = Object.keys(model.threads).length;
        const hidden = model.layout.hiddenCount;
        parts.push(
          '<div class="jp-Infinijup-summary">' +
            (managed ? this._headline() : '') +
            `<span class="jp-Infinijup-counts">${n} commit${n === 1 ? '' : 's'} · ${threads} thread${
              threads === 1 ? '' : 's'
            }${hidden ? ` · ${hidden} folded` : ''}</span></div>`
        );
      }
    }
    if (model.picking) {
      const base = model.getCommit(model.selected);
      parts.push(
        `<div class="jp-Infinijup-picking" role="status">Click the commit to compare with <code>${shortId(
          base?.id
        )}</code> · <button class="jp-Button jp-mod-styled jp-Infinijup-cancel-pick">Cancel</button></div>`
      );
    }
    this._status.node.innerHTML = parts.join('');
    this._commands.notifyCommandChanged();
  }

  /** "HEAD 1a2b3c4d · next snapshot on main" (or where else it goes). */
  private _headline(): string {
    const model = this.model;
    const head = model.head;
    const next = model.nextSnapshot;
    // A fresh kernel's next snapshot has no parent: a new root, said so
    // (engine/heads.py) when the notebook has history it does not descend from.
    const newRoot = !!next && next.isNew && !next.parent && !head?.commit;
    const where = next
      ? `${
          newRoot
            ? 'next snapshot starts new root'
            : next.isNew
              ? 'next snapshot starts new thread'
              : 'next snapshot on'
        } <b>${esc(next.thread)}</b>`
      : '';
    let text: string;
    if (head?.commit) {
      text = `HEAD <code>${shortId(head.commit)}</code>`;
      if (next?.isNew) {
        text += ' (not a thread tip)';
      }
    } else {
      text = 'Fresh kernel';
    }
    const title = newRoot
      ? `This kernel's state comes from no snapshot (it was started or restarted): its next snapshot starts the thread ${next!.thread} with no parent`
      : next
        ? next.isNew
          ? `The next snapshot starts the new thread ${next.thread}${
              next.parent ? ` from ${shortId(next.parent)}` : ''
            }`
          : `The next snapshot goes on thread ${next.thread}${
              next.parent ? `, after ${shortId(next.parent)}` : ''
            }`
        : '';
    return (
      `<span class="jp-Infinijup-headline" title="${esc(title)}">${text}` +
      (where ? ` · ${where}` : '') +
      '</span>'
    );
  }

  /** The card of the selected commit. */
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
    const panel = this._notebook;
    const kernel = panel?.sessionContext.session?.kernel ?? null;
    const managed = !!kernel && this._actions.managed.isManaged(kernel);
    const isHead = managed && model.head?.commit === commit.id;
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
    const cell = cellLabel(commit);
    const elsewhere =
      typeof commit.notebook === 'string'
        ? `<div class="jp-Infinijup-elsewhere" role="note">A snapshot of ${
            commit.notebook
              ? `<code>${esc(commit.notebook)}</code>`
              : 'another notebook'
          }: this kernel came from it</div>`
        : '';
    const notResumable = commit.resumable === false;
    const reason = commit.resumable_reason || 'not resumable on this server';

    const button = (
      action: string,
      label: string,
      title: string,
      cls = '',
      enabled = true
    ) =>
      `<button class="jp-Button jp-mod-styled${cls}" data-action="${action}" title="${esc(
        title
      )}"${enabled ? '' : ' disabled'}>${label}</button>`;
    const canOperate = this._actions.canOperate(panel);
    const canResume = this._actions.canResume(panel) && !notResumable;
    const buttons: string[] = [];
    if (managed) {
      buttons.push(
        button(
          'restore',
          'Restore',
          'Replace the running kernel with this snapshot',
          ' jp-mod-accept',
          canOperate
        ),
        button(
          'branch',
          'Branch from here',
          isHead
            ? 'Start a new thread here; the kernel is not touched'
            : 'Restore this snapshot into a new thread',
          '',
          canOperate
        )
      );
    } else {
      buttons.push(
        button(
          'resume',
          'Resume here',
          notResumable
            ? reason
            : kernel
              ? `Replace this kernel (${panel?.sessionContext.kernelDisplayName ?? ''}) with a new kernel resumed from this snapshot`
              : 'Start a kernel for this notebook from this snapshot',
          ' jp-mod-accept',
          canResume
        )
      );
    }
    buttons.push(
      button(
        'open-new',
        'Open in new notebook',
        notResumable
          ? reason
          : 'Copy this notebook and resume this snapshot in its own kernel next to this one',
        '',
        canResume
      ),
      button(
        'compare',
        model.picking ? 'Comparing…' : 'Compare…',
        'Compare the variables of this snapshot with another one (or Ctrl+click a row)',
        model.picking ? ' jp-mod-active' : ''
      ),
      button('copy', 'Copy id', 'Copy the full commit id')
    );

    node.innerHTML =
      '<div class="jp-Infinijup-details-head">' +
      `<div class="jp-Infinijup-details-title${commit.message || cell ? '' : ' jp-mod-empty'}">${esc(
        commitTitle(commit)
      )}</div>` +
      '<button class="jp-Infinijup-close" data-action="close" title="Close (deselect)" aria-label="Close">×</button></div>' +
      (commit.message && cell
        ? `<div class="jp-Infinijup-cell" title="The last cell run before this snapshot"><code>${esc(cell)}</code></div>`
        : '') +
      elsewhere +
      (notResumable
        ? `<div class="jp-Infinijup-warning" role="note">Cannot be resumed here: ${esc(reason)}</div>`
        : '') +
      `<div class="jp-Infinijup-actions">${buttons.join('')}</div>` +
      this._deleteRow(commit) +
      this._compareSection(commit) +
      this._variablesSection(commit) +
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
      sidecarsRow(commit) +
      '</tbody></table>' +
      `<details class="jp-Infinijup-metadata"><summary>Metadata</summary><pre>${esc(
        metadata
      )}</pre></details>`;
  }

  /** "Delete snapshot" and "Delete thread …" under the actions. */
  private _deleteRow(commit: ICommit): string {
    const thread = this._threadOf(commit.id);
    return (
      '<div class="jp-Infinijup-delete">' +
      `<button class="jp-Button jp-mod-styled" data-delete="snapshot" title="${esc(
        'Delete this snapshot and free its space (only a snapshot no later snapshot builds on)'
      )}">Delete snapshot</button>` +
      (thread
        ? `<button class="jp-Button jp-mod-styled" data-delete="thread" data-thread="${esc(
            thread
          )}" title="${esc(
            `Delete thread ${thread} and the snapshots only it has`
          )}">Delete thread ${esc(thread)}</button>`
        : '') +
      '</div>'
    );
  }

  /** The thread "Delete thread" offers for a commit: one it is the tip of, else its own. */
  private _threadOf(commitId: string | null | undefined): string | null {
    const commit = this.model.getCommit(commitId);
    if (!commit) {
      return null;
    }
    const tips = this.model.tips.get(commit.id) ?? [];
    if (tips.length) {
      return tips.includes(commit.thread) ? commit.thread : tips[0];
    }
    return commit.thread in this.model.threads ? commit.thread : null;
  }

  /** Ask the server for the sizes and show them in the header. */
  async refreshSpace(): Promise<void> {
    const stats = await this._space.stats();
    if (this.isDisposed) {
      return;
    }
    this._spaceLabel.textContent = spaceLine(stats);
    this._spaceLabel.title = stats
      ? `The snapshot store takes ${spaceLine(stats).replace(/^Store /, '')} on disk (${stats.commits} snapshots, ${stats.threads} threads); hot copies are recent snapshots kept uncompressed for fast restores${
          stats.hot_entries !== null ? ` (${stats.hot_entries} now)` : ''
        }.`
      : '';
  }

  /** Delete a snapshot of the shown notebook (asks first); refreshes after. */
  async deleteSnapshot(commitId: string): Promise<boolean> {
    const target = this._spaceTarget();
    if (!target || !this.model.getCommit(commitId)) {
      return false;
    }
    const done = await this._space.deleteSnapshot(target, this.model, commitId);
    return this._deleted(done !== null);
  }

  /** Delete a thread of the shown notebook (asks first); refreshes after. */
  async deleteThread(name: string): Promise<boolean> {
    const target = this._spaceTarget();
    if (!target || !(name in this.model.threads)) {
      return false;
    }
    const done = await this._space.deleteThread(target, this.model, name);
    return this._deleted(done !== null);
  }

  private async _deleted(done: boolean): Promise<boolean> {
    if (done) {
      await this.model.refresh();
      // the model checks its selection against its cache of the old history
      const selected = this.model.selected;
      if (selected && !this.model.getCommit(selected)) {
        this.model.select(null);
      }
      await this.refreshSpace();
    }
    return done;
  }

  private _spaceTarget(): { path: string; kernelId: string | null } | null {
    const target = this.model.target;
    return target ? { path: target.path, kernelId: target.kernelId } : null;
  }

  private _addCommands(): IDisposable[] {
    const added: IDisposable[] = [];
    const commitOf = (args: { [key: string]: any }): string | null =>
      typeof args.commit === 'string' && args.commit
        ? args.commit
        : args.fromContextMenu && this._contextCommit
          ? this._contextCommit
          : this.model.selected;
    if (!this._commands.hasCommand(DELETE_SNAPSHOT_COMMAND)) {
      added.push(
        this._commands.addCommand(DELETE_SNAPSHOT_COMMAND, {
          label: args => {
            const id = commitOf(args);
            return id ? `Delete Snapshot ${shortId(id)}…` : 'Delete Snapshot…';
          },
          caption: 'Delete a snapshot and free its space',
          isEnabled: args => !!this.model.getCommit(commitOf(args)),
          execute: args => {
            const id = commitOf(args);
            return id ? this.deleteSnapshot(id) : false;
          }
        })
      );
    }
    if (!this._commands.hasCommand(DELETE_THREAD_COMMAND)) {
      added.push(
        this._commands.addCommand(DELETE_THREAD_COMMAND, {
          label: args => {
            const name =
              typeof args.thread === 'string'
                ? args.thread
                : this._threadOf(commitOf(args));
            return name ? `Delete Thread ${name}…` : 'Delete Thread…';
          },
          caption: 'Delete a thread and the snapshots only it has',
          isEnabled: args =>
            typeof args.thread === 'string' || !!this._threadOf(commitOf(args)),
          execute: args => {
            const name =
              typeof args.thread === 'string'
                ? args.thread
                : this._threadOf(commitOf(args));
            return name ? this.deleteThread(name) : false;
          }
        })
      );
    }
    return added;
  }

  private _onContextMenu = (event: MouseEvent) => {
    const row = (event.target as HTMLElement | null)?.closest<HTMLElement>(
      '[data-commit-id]'
    );
    this._contextCommit = row?.dataset.commitId ?? null;
  };

  /** The variables the commit changed (and, folded, all of them). */
  private _variablesSection(commit: ICommit): string {
    const vars = variablesOf(commit);
    if (!vars) {
      return '<div class="jp-Infinijup-vars jp-mod-missing">Variables: not recorded for this snapshot (taken before Infinijup recorded them).</div>';
    }
    const parent = this.model.getCommit(commit.parents[0]);
    const changed = vars.items.filter(v => v.changed);
    const removed = removedVariables(commit, parent);
    const total = `${vars.items.length}${vars.truncated ? '+' : ''}`;
    const what = commit.parents.length ? 'since its parent' : 'new';
    let html =
      `<div class="jp-Infinijup-vars"><div class="jp-Infinijup-section">Changed variables <span class="jp-Infinijup-dim">(${changed.length} of ${total}, ${what})</span></div>` +
      (changed.length
        ? variableTable(changed)
        : '<div class="jp-Infinijup-dim">No variable changed.</div>');
    if (removed.length) {
      html += `<div class="jp-Infinijup-removed">Deleted: ${removed
        .map(name => `<code>${esc(name)}</code>`)
        .join(', ')}</div>`;
    }
    if (vars.items.length > changed.length) {
      html += `<details class="jp-Infinijup-allvars"><summary>All ${total} variables</summary>${variableTable(
        vars.items
      )}</details>`;
    }
    if (vars.truncated) {
      html +=
        '<div class="jp-Infinijup-dim">The kernel listed only part of its variables.</div>';
    }
    return html + '</div>';
  }

  /** Which variables differ from the compared commit. */
  private _compareSection(commit: ICommit): string {
    const other = this.model.getCommit(this.model.compareWith);
    if (!other) {
      return '';
    }
    const a = shortId(commit.id);
    const b = shortId(other.id);
    const cmp = compareCommits(commit, other);
    let html =
      '<div class="jp-Infinijup-compare"><div class="jp-Infinijup-section">' +
      `Compared with <code>${b}</code> <span class="jp-Infinijup-dim">${esc(
        truncate(commitTitle(other), 40)
      )}</span>` +
      '<button class="jp-Infinijup-link" data-action="stop-compare">Stop</button></div>';
    if (!cmp.available) {
      html +=
        '<div class="jp-Infinijup-dim">Variables were not recorded for one of the two snapshots.</div>';
    } else if (cmp.diffs.length === 0) {
      html += `<div>No variable differs (${cmp.same.length} identical).</div>`;
    } else {
      html += '<ul class="jp-Infinijup-diffs">';
      for (const d of cmp.diffs) {
        const name = `<code class="jp-Infinijup-varname">${esc(d.name)}</code>`;
        if (d.kind === 'changed') {
          html += `<li data-kind="changed">${name} differs: ${describeVar(
            d.a!
          )} → ${describeVar(d.b!)}</li>`;
        } else if (d.kind === 'only-a') {
          html += `<li data-kind="only-a">${name} only in <code>${a}</code> (${describeVar(
            d.a!
          )})</li>`;
        } else {
          html += `<li data-kind="only-b">${name} only in <code>${b}</code> (${describeVar(
            d.b!
          )})</li>`;
        }
      }
      html += `</ul><div class="jp-Infinijup-dim">${cmp.diffs.length} differ${
        cmp.diffs.length === 1 ? 's' : ''
      }, ${cmp.same.length} identical.</div>`;
    }
    if (cmp.partial) {
      html +=
        '<div class="jp-Infinijup-dim">Only the listed variables were compared (a list was truncated).</div>';
    }
    return html + '</div>';
  }

  private _onSearchKey = (event: KeyboardEvent) => {
    if (event.key === 'Escape') {
      this._searchInput.value = '';
      this.model.query = '';
      return;
    }
    if (event.key !== 'Enter') {
      return;
    }
    event.preventDefault();
    const matches = this.model.matches;
    if (!matches || matches.length === 0) {
      return;
    }
    // The next match after the selection (in graph order), wrapping.
    const layout = this.model.layout;
    const order = [...matches].sort(
      (x, y) => (layout.rowOf.get(x) ?? 0) - (layout.rowOf.get(y) ?? 0)
    );
    const current = this.model.selected
      ? (layout.rowOf.get(this.model.selected) ?? -1)
      : -1;
    const next =
      order.find(id => (layout.rowOf.get(id) ?? -1) > current) ?? order[0];
    const row = this.model.reveal(next);
    this.model.select(next);
    if (row !== undefined) {
      this.graph.scrollToRow(row);
    }
  };

  private _onStatusClick = (event: MouseEvent) => {
    const target = event.target as HTMLElement;
    if (target.closest('.jp-Infinijup-retry')) {
      void this.model.refresh();
    } else if (target.closest('.jp-Infinijup-change-kernel')) {
      this._notebook?.activate();
      void this._commands.execute(CHANGE_KERNEL_COMMAND);
    } else if (target.closest('.jp-Infinijup-cancel-pick')) {
      this.model.picking = false;
    }
  };

  private _onDetailsClick = (event: MouseEvent) => {
    const target = event.target as HTMLElement;
    const commit = this.model.selected;
    const remove = target.closest<HTMLElement>('[data-delete]');
    if (remove && commit) {
      if (remove.dataset.delete === 'thread' && remove.dataset.thread) {
        void this.deleteThread(remove.dataset.thread);
      } else if (remove.dataset.delete === 'snapshot') {
        void this.deleteSnapshot(commit);
      }
      return;
    }
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
        case 'resume':
          void this._commands.execute(CommandIDs.resume, {
            commit,
            notebookId
          });
          break;
        case 'open-new':
          void this._commands.execute(CommandIDs.openInNewNotebook, {
            commit,
            notebookId
          });
          break;
        case 'compare':
          this.model.picking = !this.model.picking;
          break;
        case 'stop-compare':
          this.model.setCompare(null);
          break;
        case 'copy':
          void this._commands.execute(CommandIDs.copyId, { commit });
          break;
        case 'close':
          this.model.select(null);
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
  private _space: SpaceActions;
  private _spaceLabel: HTMLElement;
  private _contextCommit: string | null = null;
  private _commandsAdded: IDisposable[];
  private _notebook: NotebookPanel | null = null;
  private _notebookLabel: HTMLElement;
  private _fold: Widget;
  private _foldInput: HTMLInputElement;
  private _cellsToggle: Widget;
  private _cellsInput: HTMLInputElement;
  private _search: Widget;
  private _searchInput: HTMLInputElement;
  private _searchCount: HTMLElement;
  private _status: Widget;
  private _details: Widget;
}

export namespace HistoryPanel {
  export interface IOptions {
    model: HistoryModel;
    actions: InfinijupActions;
    commands: CommandRegistry;
    /** Deletes and sizes (default: the server's, with JupyterLab's dialogs). */
    space?: SpaceActions;
  }
}

/** JupyterLab's notifications for the deletes. */
const labNotifier: INotifier = {
  emit: (message, type, options) =>
    Notification.emit(message, type, {
      autoClose: options?.autoClose ?? 5000
    }),
  update: args => Notification.update(args),
  dismiss: id => Notification.dismiss(id)
};

/** A confirmation dialog whose body keeps its line breaks. */
const labConfirm: Confirm = async (title, body, accept) => {
  const content = new Widget();
  content.addClass('jp-Infinijup-confirm');
  content.node.textContent = body;
  const result = await showDialog({
    title,
    body: content,
    buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: accept })]
  });
  return !!result?.button?.accept;
};

/** "DataFrame (1000, 3), 24 KiB" */
function describeVar(v: IVariableInfo): string {
  return esc(describeVariable(v));
}

function variableTable(items: readonly IVariableInfo[]): string {
  return (
    '<table class="jp-Infinijup-vartable"><tbody>' +
    items
      .map(
        v =>
          `<tr data-var="${esc(v.name)}"><td><code class="jp-Infinijup-varname">${esc(
            v.name
          )}</code></td><td class="jp-Infinijup-vartype">${esc(v.type)}${
            v.shape
              ? ` <span class="jp-Infinijup-dim">${esc(v.shape)}</span>`
              : ''
          }</td><td class="jp-Infinijup-varsize">${formatBytes(v.size)}</td></tr>`
      )
      .join('') +
    '</tbody></table>'
  );
}

function truncate(text: string, n: number): string {
  return text.length > n ? text.slice(0, n - 1) + '…' : text;
}

/** The sidecars in the snapshot (started with `%sidecar`), when there are any. */
function sidecarsRow(commit: ICommit): string {
  const sidecars = sidecarsOf(commit);
  if (!sidecars.length) {
    return '';
  }
  const items = sidecars.map(
    s =>
      `<code title="${esc(s.argv.join(' '))}">${esc(s.name)}</code> (${
        s.running ? 'running' : 'exited'
      })`
  );
  return `<tr><th>Sidecars</th><td class="jp-Infinijup-sidecars">${items.join(', ')}</td></tr>`;
}
