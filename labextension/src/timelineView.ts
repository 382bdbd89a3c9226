/**
 * The history panel's "Cells" view: the per-cell timeline (cellTimeline.ts)
 * of the kernel's path, one row per cell that made a snapshot. Automatic
 * snapshots are quiet and fold into runs; manual ones stand out with their
 * message; gaps say which cells made none. A row selects its snapshot (the
 * card above then offers Restore), as a row of the graph does.
 */

import { Widget } from '@lumino/widgets';

import {
  cellTimeline,
  countLabel,
  foldText,
  ITimelineCell,
  skippedText,
  TimelineEntry
} from './cellTimeline';
import {
  formatAge,
  formatAgeShort,
  formatDate,
  hasGpu,
  shortId
} from './format';
import { autoChipHtml, esc, gpuChipHtml } from './graphview';
import type { HistoryModel } from './model';

/** Changed variables named in a row, before "+N". */
const MAX_VARS = 3;

export class TimelineView extends Widget {
  constructor(model: HistoryModel) {
    super();
    this.model = model;
    this.addClass('jp-Infinijup-timeline');
    this.node.tabIndex = 0;
    this.node.setAttribute('role', 'listbox');
    this.node.setAttribute('aria-label', 'Cells of the kernel history');
    this.node.addEventListener('click', this._onClick);
    this.node.addEventListener('keydown', this._onKeyDown);
    model.changed.connect(this._onModelChanged, this);
  }

  readonly model: HistoryModel;

  /** The rows now shown (for tests). */
  get entries(): readonly TimelineEntry[] {
    return this._entries;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this.node.removeEventListener('click', this._onClick);
    this.node.removeEventListener('keydown', this._onKeyDown);
    this.model.changed.disconnect(this._onModelChanged, this);
    super.dispose();
  }

  /** Draw again from the model (cheap: a path of a few hundred cells). */
  render(): void {
    const model = this.model;
    const pinned = new Set<string>(Object.values(model.threads));
    this._entries = cellTimeline(model.commits, model.head, model.threads, {
      pinned,
      expanded: this._expanded,
      matches: model.matches ? id => model.isMatch(id) : null
    });
    if (this._entries.length === 0) {
      this.node.innerHTML = `<div class="jp-Infinijup-timeline-empty">${
        model.matches
          ? 'No cell on this path matches the search.'
          : 'No snapshot on this path yet.'
      }</div>`;
      return;
    }
    this.node.innerHTML = this._entries
      .map(e => (e.kind === 'fold' ? this._foldRow(e) : this._cellRow(e)))
      .join('');
  }

  protected onAfterShow(): void {
    this.render();
  }

  protected onAfterHide(): void {
    // No hidden rows for the graph's row selectors to find.
    this.node.innerHTML = '';
    this._entries = [];
  }

  private _onModelChanged(
    _: HistoryModel,
    kind: HistoryModel.ChangeKind
  ): void {
    if (!this.isVisible) {
      return;
    }
    if (kind === 'selection') {
      const selected = this.model.selected;
      for (const el of this.node.querySelectorAll<HTMLElement>(
        '[data-commit-id]'
      )) {
        const on = el.dataset.commitId === selected;
        el.classList.toggle('jp-mod-selected', on);
        el.toggleAttribute('aria-selected', on);
      }
    } else {
      this.render();
    }
  }

  private _cellRow(e: ITimelineCell): string {
    const c = e.commit;
    const classes = ['jp-Infinijup-row', 'jp-Infinijup-cellrow'];
    classes.push(e.auto ? 'jp-mod-auto' : 'jp-mod-manual');
    if (e.head) {
      classes.push('jp-mod-head');
    }
    if (e.ahead) {
      classes.push('jp-mod-ahead');
    }
    if (e.thinned) {
      classes.push('jp-mod-thinned');
    }
    if (c.id === this.model.selected) {
      classes.push('jp-mod-selected');
    }
    const chips: string[] = [];
    if (e.head) {
      chips.push(
        '<span class="jp-Infinijup-chip jp-Infinijup-chip-head" title="The kernel is here">HEAD</span>'
      );
    }
    if (e.ahead) {
      chips.push(
        '<span class="jp-Infinijup-chip" title="Undone: newer than where the kernel is; Redo (or a restore) brings it back">undone</span>'
      );
    }
    chips.push(autoChipHtml(c));
    if (hasGpu(c)) {
      chips.push(gpuChipHtml(c));
    }
    const source = e.source
      ? `<code class="jp-Infinijup-cell-source">${esc(e.source)}</code>`
      : '<span class="jp-Infinijup-cell-source jp-mod-empty">(cell not recorded)</span>';
    const message =
      !e.auto && c.message
        ? `<span class="jp-Infinijup-cell-message">${esc(c.message.split('\n')[0])}</span>`
        : '';
    const vars = e.changed.length
      ? `<span class="jp-Infinijup-cell-vars" title="Changed: ${esc(
          e.changed.join(', ')
        )}">${esc(e.changed.slice(0, MAX_VARS).join(', '))}${
          e.changed.length > MAX_VARS ? ` +${e.changed.length - MAX_VARS}` : ''
        }</span>`
      : '';
    const row =
      `<div class="${classes.join(' ')}" role="option" data-commit-id="${c.id}"` +
      `${c.id === this.model.selected ? ' aria-selected="true"' : ''}` +
      ` title="${esc(`${countLabel(e.count)} ${e.source}`)}">` +
      `<span class="jp-Infinijup-cell-count">${countLabel(e.count)}</span>` +
      `<div class="jp-Infinijup-row-text"><div class="jp-Infinijup-row-line">${message}${source}</div>` +
      `<div class="jp-Infinijup-row-meta">${chips.join('')}<code class="jp-Infinijup-id">${shortId(
        c.id
      )}</code>${vars}<span class="jp-Infinijup-age" title="${esc(
        `${formatDate(c.created)} (${formatAge(c.created)})`
      )}">${esc(formatAgeShort(c.created))}</span></div></div></div>`;
    const gap = e.skipped
      ? `<div class="jp-Infinijup-cell-gap">${esc(skippedText(e.skipped))}</div>`
      : '';
    return row + gap;
  }

  private _foldRow(e: TimelineEntry & { kind: 'fold' }): string {
    const last = e.cells[e.cells.length - 1];
    const gap = last.skipped
      ? `<div class="jp-Infinijup-cell-gap">${esc(skippedText(last.skipped))}</div>`
      : '';
    return (
      `<div class="jp-Infinijup-row jp-Infinijup-cellrow jp-mod-fold" role="option" data-fold="${e.key}" title="Show each of them">` +
      `<span class="jp-Infinijup-cell-count">⋯</span><div class="jp-Infinijup-row-text"><div class="jp-Infinijup-row-line">` +
      `<span class="jp-Infinijup-row-message">${esc(foldText(e))} <span class="jp-Infinijup-expand">show</span></span></div></div></div>` +
      gap
    );
  }

  private _onClick = (event: MouseEvent): void => {
    const el = (event.target as HTMLElement).closest<HTMLElement>(
      '.jp-Infinijup-cellrow'
    );
    if (!el) {
      return;
    }
    if (el.dataset.fold) {
      this._expanded.add(el.dataset.fold);
      this.render();
    } else if (el.dataset.commitId) {
      if (
        (event.ctrlKey || event.metaKey) &&
        this.model.getCommit(this.model.selected)
      ) {
        this.model.setCompare(el.dataset.commitId);
      } else {
        this.model.select(el.dataset.commitId);
      }
    }
  };

  private _onKeyDown = (event: KeyboardEvent): void => {
    if (event.key !== 'ArrowDown' && event.key !== 'ArrowUp') {
      return;
    }
    const ids = this._entries
      .filter((e): e is ITimelineCell => e.kind === 'cell')
      .map(e => e.commit.id);
    if (ids.length === 0) {
      return;
    }
    const at = ids.indexOf(this.model.selected ?? '');
    const next =
      event.key === 'ArrowDown'
        ? Math.min(ids.length - 1, at + 1)
        : Math.max(0, at - 1);
    event.preventDefault();
    this.model.select(ids[next]);
    this.node
      .querySelector(`[data-commit-id="${ids[next]}"]`)
      ?.scrollIntoView({ block: 'nearest' });
  };

  private _entries: TimelineEntry[] = [];
  private _expanded = new Set<string>();
}
