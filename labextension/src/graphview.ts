/**
 * The commit graph, drawn row by row with virtualized rendering: only the
 * rows in (and near) the viewport are in the DOM, each with its own small
 * SVG for the lanes, so opening or scrolling a history of thousands of
 * commits costs the same as a few dozen.
 */

import { Message } from '@lumino/messaging';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { cellLabel, commitTitle } from './commits';
import {
  commitTooltip,
  formatAge,
  formatAgeShort,
  formatBytes,
  formatDate,
  hasGpu,
  shortId
} from './format';
import type { ILayoutRow, ISegment } from './layout';
import type { HistoryModel } from './model';
import type { ICommit } from './types';

/** Row height in px (keep in sync with --jp-infinijup-row-height). */
export const ROW_HEIGHT = 44;
/** Lane width in px (narrower when many lanes meet a narrow panel). */
export const LANE_WIDTH = 14;
const MIN_LANE_WIDTH = 6;
/** Share of the panel width the graph column may take before lanes shrink. */
const GRAPH_SHARE = 0.35;
/** Left and right padding of the graph column. */
const PAD = 6;
/** Rows rendered beyond the viewport on each side. */
const OVERSCAN = 8;
/** Rows rendered when the viewport has no size yet (hidden panel). */
const DEFAULT_VISIBLE = 40;

export class GraphView extends Widget {
  constructor(model: HistoryModel) {
    super();
    this.model = model;
    this.addClass('jp-Infinijup-graph');
    this.node.tabIndex = 0;
    this.node.setAttribute('role', 'listbox');
    this.node.setAttribute('aria-label', 'Kernel history');
    this._spacer = document.createElement('div');
    this._spacer.className = 'jp-Infinijup-graph-spacer';
    this.node.appendChild(this._spacer);
    model.changed.connect(this._onModelChanged, this);
  }

  readonly model: HistoryModel;

  /** Emitted when a collapsed run is clicked (after it is expanded). */
  get expanded(): ISignal<this, string> {
    return this._expanded;
  }

  /** Duration of the last full render, in ms (for benchmarks). */
  get lastRenderMs(): number {
    return this._lastRenderMs;
  }

  /** Number of row elements now in the DOM. */
  get renderedRows(): number {
    return this._rows.size;
  }

  /** Scroll so that a row is visible. */
  scrollToRow(row: number): void {
    const top = row * ROW_HEIGHT;
    const bottom = top + ROW_HEIGHT;
    const node = this.node;
    if (top < node.scrollTop) {
      node.scrollTop = top;
    } else if (bottom > node.scrollTop + node.clientHeight) {
      node.scrollTop = bottom - node.clientHeight;
    }
    this._render();
  }

  /** Redraw everything (the layout changed). */
  invalidate(): void {
    const t0 = performance.now();
    const layout = this.model.layout; // computed here when stale
    const t1 = performance.now();
    for (const el of this._rows.values()) {
      el.remove();
    }
    this._rows.clear();
    this._render();
    const t2 = performance.now();
    // Exposed for benchmarks (ui-tests/bench).
    this.node.dataset.layoutMs = (t1 - t0).toFixed(2);
    this.node.dataset.renderMs = (t2 - t1).toFixed(2);
    this.node.dataset.rows = String(layout.rows.length);
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    if (this._frame) {
      cancelAnimationFrame(this._frame);
    }
    super.dispose();
  }

  handleEvent(event: Event): void {
    switch (event.type) {
      case 'scroll':
        this._scheduleRender();
        break;
      case 'click':
        this._onClick(event as MouseEvent);
        break;
      case 'contextmenu':
        this._onContextMenu(event as MouseEvent);
        break;
      case 'keydown':
        this._onKeyDown(event as KeyboardEvent);
        break;
    }
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    this.node.addEventListener('scroll', this, { passive: true });
    this.node.addEventListener('click', this);
    this.node.addEventListener('contextmenu', this);
    this.node.addEventListener('keydown', this);
    this.invalidate();
  }

  protected onBeforeDetach(msg: Message): void {
    this.node.removeEventListener('scroll', this);
    this.node.removeEventListener('click', this);
    this.node.removeEventListener('contextmenu', this);
    this.node.removeEventListener('keydown', this);
    super.onBeforeDetach(msg);
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this._render();
  }

  protected onResize(msg: Widget.ResizeMessage): void {
    super.onResize(msg);
    this._scheduleRender();
  }

  private _onModelChanged(
    _: HistoryModel,
    kind: HistoryModel.ChangeKind
  ): void {
    switch (kind) {
      case 'history':
      case 'layout':
      case 'target':
        this.invalidate();
        break;
      case 'selection':
        this._updateSelection();
        break;
      default:
        break;
    }
  }

  private _scheduleRender(): void {
    if (!this._frame) {
      this._frame = requestAnimationFrame(() => {
        this._frame = 0;
        this._render();
      });
    }
  }

  /** Render the rows in the viewport, remove the others. */
  private _render(): void {
    if (this.isDisposed) {
      return;
    }
    const t0 = performance.now();
    const layout = this.model.layout;
    const rows = layout.rows;
    const lanes = Math.max(1, layout.laneCount);
    const width = this.node.clientWidth;
    const laneWidth =
      width > 0
        ? Math.max(
            MIN_LANE_WIDTH,
            Math.min(
              LANE_WIDTH,
              Math.floor((width * GRAPH_SHARE - 2 * PAD) / lanes)
            )
          )
        : LANE_WIDTH;
    if (laneWidth !== this._laneWidth) {
      // Lane width changed (resize, more lanes): redraw all rows.
      this._laneWidth = laneWidth;
      for (const el of this._rows.values()) {
        el.remove();
      }
      this._rows.clear();
    }
    const graphWidth = PAD * 2 + lanes * laneWidth;
    this.node.style.setProperty(
      '--jp-infinijup-graph-width',
      `${graphWidth}px`
    );
    this._spacer.style.height = `${rows.length * ROW_HEIGHT}px`;

    const viewport = this.node.clientHeight;
    const scrollTop = this.node.scrollTop;
    const visible =
      viewport > 0 ? Math.ceil(viewport / ROW_HEIGHT) : DEFAULT_VISIBLE;
    const first = Math.max(0, Math.floor(scrollTop / ROW_HEIGHT) - OVERSCAN);
    const last = Math.min(
      rows.length,
      Math.floor(scrollTop / ROW_HEIGHT) + visible + OVERSCAN
    );

    for (const [index, el] of this._rows) {
      if (index < first || index >= last || index >= rows.length) {
        el.remove();
        this._rows.delete(index);
      }
    }
    const fragment = document.createDocumentFragment();
    for (let i = first; i < last; i++) {
      if (!this._rows.has(i)) {
        const el = this._renderRow(rows[i], i, graphWidth, laneWidth);
        this._rows.set(i, el);
        fragment.appendChild(el);
      }
    }
    this._spacer.appendChild(fragment);
    this._lastRenderMs = performance.now() - t0;
  }

  private _renderRow(
    row: ILayoutRow<ICommit>,
    index: number,
    graphWidth: number,
    laneWidth: number
  ): HTMLElement {
    const model = this.model;
    const node = row.node;
    const el = document.createElement('div');
    el.className = 'jp-Infinijup-row';
    el.style.top = `${index * ROW_HEIGHT}px`;
    el.dataset.row = String(index);
    el.dataset.nodeId = node.id;
    el.setAttribute('role', 'option');

    const head = model.head?.commit ?? null;
    let text: string;
    if (node.kind === 'commit') {
      const c = node.commit;
      el.dataset.commitId = c.id;
      el.title = commitTooltip(c);
      if (c.id === head) {
        el.classList.add('jp-mod-head');
      }
      if (!model.isMatch(c.id)) {
        el.classList.add('jp-mod-dimmed');
      } else if (model.matches) {
        el.classList.add('jp-mod-match');
      }
      if (c.id === model.compareWith) {
        el.classList.add('jp-mod-compare');
      }
      const gpu = hasGpu(c);
      if (gpu) {
        el.classList.add('jp-mod-gpu');
      }
      if (c.metadata?.auto) {
        el.classList.add('jp-mod-auto'); // quieter: the user's own snapshots stand out
      }
      const chips: string[] = [];
      for (const name of model.tips.get(c.id) ?? []) {
        chips.push(
          `<span class="jp-Infinijup-chip jp-Infinijup-chip-thread c${layoutColor(
            model,
            name
          )}" title="Tip of thread ${esc(name)}">${esc(name)}</span>`
        );
      }
      if (c.id === head) {
        const next = model.nextSnapshot;
        const where = next
          ? next.isNew
            ? `starts the new thread ${next.thread}`
            : `goes to thread ${next.thread}`
          : 'goes after it';
        chips.push(
          `<span class="jp-Infinijup-chip jp-Infinijup-chip-head" title="The kernel is at this commit; the next snapshot ${esc(
            where
          )}">HEAD</span>`
        );
      }
      const gpuChip = gpu ? gpuChipHtml(c) : '';
      const autoChip = autoChipHtml(c);
      const kind = c.message
        ? ''
        : cellLabel(c)
          ? ' jp-mod-derived'
          : ' jp-mod-empty';
      // Line 1: thread tips and HEAD, then the label (which gives way);
      // line 2: id, GPU, age, size (hidden when narrow): never cut.
      text =
        `<div class="jp-Infinijup-row-line">${chips.join('')}` +
        `<span class="jp-Infinijup-row-message${kind}">${esc(commitTitle(c))}</span></div>` +
        `<div class="jp-Infinijup-row-meta"><code class="jp-Infinijup-id">${shortId(
          c.id
        )}</code>${gpuChip}${autoChip}<span class="jp-Infinijup-age" title="${esc(
          `${formatDate(c.created)} (${formatAge(c.created)})`
        )}">${esc(formatAgeShort(c.created))}</span><span class="jp-Infinijup-size" title="Stored ${formatBytes(
          c.stats.stored_bytes
        )} (image ${formatBytes(c.stats.image_bytes)})">${formatBytes(
          c.stats.stored_bytes
        )}</span></div>`;
    } else {
      el.classList.add('jp-mod-collapsed');
      if (model.matches) {
        el.classList.add('jp-mod-dimmed');
      }
      const newest = node.commits[0];
      const oldest = node.commits[node.commits.length - 1];
      const stored = node.commits.reduce((s, c) => s + c.stats.stored_bytes, 0);
      const gpu = node.commits.filter(hasGpu).length;
      el.title = `${node.commits.length} commits on ${node.thread}, click to show them`;
      text =
        `<div class="jp-Infinijup-row-line"><span class="jp-Infinijup-row-message">${node.commits.length} more commits on ${esc(
          node.thread
        )} <span class="jp-Infinijup-expand">show</span></span></div>` +
        `<div class="jp-Infinijup-row-meta"><code class="jp-Infinijup-id">${shortId(
          newest.id
        )}…${shortId(oldest.id)}</code>${
          gpu
            ? `<span class="jp-Infinijup-chip jp-Infinijup-chip-gpu">${gpu} GPU</span>`
            : ''
        }<span class="jp-Infinijup-age" title="${esc(
          `${formatAge(oldest.created)} – ${formatAge(newest.created)}`
        )}">${esc(formatAgeShort(oldest.created))}–${esc(
          formatAgeShort(newest.created)
        )}</span><span class="jp-Infinijup-size">${formatBytes(stored)}</span></div>`;
    }
    if (model.selected === node.id) {
      el.classList.add('jp-mod-selected');
      el.setAttribute('aria-selected', 'true');
    }
    el.innerHTML =
      rowSvg(row, graphWidth, node.id === head, laneWidth) +
      `<div class="jp-Infinijup-row-text">${text}</div>`;
    return el;
  }

  private _updateSelection(): void {
    const selected = this.model.selected;
    const compare = this.model.compareWith;
    this.node.classList.toggle('jp-mod-picking', this.model.picking);
    for (const el of this._rows.values()) {
      const on = el.dataset.nodeId === selected;
      el.classList.toggle('jp-mod-compare', el.dataset.nodeId === compare);
      el.classList.toggle('jp-mod-selected', on);
      if (on) {
        el.setAttribute('aria-selected', 'true');
      } else {
        el.removeAttribute('aria-selected');
      }
    }
  }

  private _rowElement(target: EventTarget | null): HTMLElement | null {
    let el = target as HTMLElement | null;
    while (el && el !== this.node) {
      if (el.classList?.contains('jp-Infinijup-row')) {
        return el;
      }
      el = el.parentElement;
    }
    return null;
  }

  private _activate(el: HTMLElement): void {
    const index = Number(el.dataset.row);
    const row = this.model.layout.rows[index];
    if (!row) {
      return;
    }
    if (row.node.kind === 'collapsed') {
      const key = row.node.key;
      this.model.expand(key);
      this._expanded.emit(key);
    } else {
      this.model.select(row.node.id);
    }
  }

  private _onClick(event: MouseEvent): void {
    const el = this._rowElement(event.target);
    if (!el) {
      return;
    }
    // Ctrl/Cmd-click: compare with the selected commit.
    if (
      (event.ctrlKey || event.metaKey) &&
      el.dataset.commitId &&
      this.model.getCommit(this.model.selected)
    ) {
      this.model.setCompare(el.dataset.commitId);
      return;
    }
    this._activate(el);
  }

  private _onContextMenu(event: MouseEvent): void {
    // Runs before JupyterLab's context menu (document listener), so the
    // menu's commands act on the row under the pointer.
    const el = this._rowElement(event.target);
    if (el && el.dataset.commitId) {
      this.model.select(el.dataset.commitId);
    }
  }

  private _onKeyDown(event: KeyboardEvent): void {
    if (event.key === 'Escape' && this.model.picking) {
      this.model.picking = false;
      event.preventDefault();
      return;
    }
    const rows = this.model.layout.rows;
    if (rows.length === 0) {
      return;
    }
    const current = this.model.selected
      ? (this.model.layout.rowOf.get(this.model.selected) ?? -1)
      : -1;
    let next = current;
    switch (event.key) {
      case 'ArrowDown':
        next = Math.min(rows.length - 1, current + 1);
        break;
      case 'ArrowUp':
        next = Math.max(0, current - 1);
        break;
      case 'Home':
        next = 0;
        break;
      case 'End':
        next = rows.length - 1;
        break;
      case 'Enter':
        if (current >= 0 && rows[current].node.kind === 'collapsed') {
          const node = rows[current].node;
          this.model.expand(node.kind === 'collapsed' ? node.key : '');
          event.preventDefault();
        }
        return;
      default:
        return;
    }
    event.preventDefault();
    this.model.select(rows[next].node.id);
    this.scrollToRow(next);
  }

  private _spacer: HTMLElement;
  private _laneWidth = LANE_WIDTH;
  private _rows = new Map<number, HTMLElement>();
  private _frame = 0;
  private _lastRenderMs = 0;
  private _expanded = new Signal<this, string>(this);
}

function layoutColor(model: HistoryModel, thread: string): number {
  return model.layout.threadColors.get(thread) ?? 0;
}

function laneX(lane: number, laneWidth: number): number {
  return PAD + lane * laneWidth + laneWidth / 2;
}

/** The SVG of one row: lines through, into and out of the node, and the node. */
export function rowSvg(
  row: ILayoutRow<ICommit>,
  width: number,
  isHead: boolean,
  laneWidth = LANE_WIDTH
): string {
  const h = ROW_HEIGHT;
  const yc = h / 2;
  const laneX_ = (lane: number) => laneX(lane, laneWidth);
  const xn = laneX_(row.lane);
  const paths: string[] = [];
  const line = (seg: ISegment, d: string, extra = '') =>
    paths.push(`<path class="c${seg.color}${extra}" d="${d}"/>`);

  for (const seg of row.through) {
    const x = laneX_(seg.lane);
    line(seg, `M${x} 0V${h}`);
  }
  for (const seg of row.into) {
    const x = laneX_(seg.lane);
    line(
      seg,
      x === xn
        ? `M${x} 0V${yc}`
        : `M${x} 0C${x} ${yc * 0.7} ${xn} ${yc * 0.3} ${xn} ${yc}`
    );
  }
  for (const seg of row.out) {
    const x = laneX_(seg.lane);
    if (seg.dangling) {
      line(seg, `M${xn} ${yc}V${h}`, ' jp-mod-dangling');
    } else {
      line(
        seg,
        x === xn
          ? `M${x} ${yc}V${h}`
          : `M${xn} ${yc}C${xn} ${yc + yc * 0.7} ${x} ${yc + yc * 0.3} ${x} ${h}`
      );
    }
  }
  let dot: string;
  const c = `c${row.color}`;
  if (row.node.kind === 'collapsed') {
    dot = `<rect class="jp-Infinijup-node jp-mod-collapsed ${c}" x="${xn - 3.5}" y="${
      yc - 9
    }" width="7" height="18" rx="3.5"/>`;
  } else if (isHead) {
    dot = `<circle class="jp-Infinijup-node jp-mod-head ${c}" cx="${xn}" cy="${yc}" r="6"/>`;
  } else if (hasGpu(row.node.commit)) {
    dot = `<rect class="jp-Infinijup-node jp-mod-gpu ${c}" x="${xn - 4.5}" y="${
      yc - 4.5
    }" width="9" height="9" rx="1.5"/>`;
  } else {
    dot = `<circle class="jp-Infinijup-node ${c}" cx="${xn}" cy="${yc}" r="4.5"/>`;
  }
  return `<svg class="jp-Infinijup-row-graph" width="${width}" height="${h}" viewBox="0 0 ${width} ${h}" aria-hidden="true">${paths.join(
    ''
  )}${dot}</svg>`;
}

/** The GPU chip of a commit that holds GPU state. */
export function gpuChipHtml(c: ICommit): string {
  return `<span class="jp-Infinijup-chip jp-Infinijup-chip-gpu" title="Holds GPU state (${formatBytes(
    c.stats.gpu_bytes ?? 0
  )})">GPU</span>`;
}

/** "thinned" or "auto" for an automatic snapshot ('' for the user's own). */
export function autoChipHtml(c: ICommit): string {
  if (c.thinned) {
    return '<span class="jp-Infinijup-chip jp-Infinijup-chip-auto" title="An automatic snapshot thinned with age: its record stays, its images are gone">thinned</span>';
  }
  return c.metadata?.auto
    ? '<span class="jp-Infinijup-chip jp-Infinijup-chip-auto" title="Taken automatically after this cell (Undo goes back through these)">auto</span>'
    : '';
}

const ESC: { [c: string]: string } = {
  '&': '&amp;',
  '<': '&lt;',
  '>': '&gt;',
  '"': '&quot;',
  "'": '&#39;'
};

/** Escape text for HTML. */
export function esc(text: string): string {
  return String(text).replace(/[&<>"']/g, c => ESC[c]);
}
