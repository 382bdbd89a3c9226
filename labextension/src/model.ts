/**
 * The history model of one notebook: its commits, threads and head, the
 * operation running on its kernel, the selection and the graph layout.
 *
 * Pure TypeScript (Lumino signals only): the API is injected, events are
 * pushed in with `handleEvent`, so it is unit tested without JupyterLab.
 */

import type { IDisposable } from '@lumino/disposable';
import { ISignal, Signal } from '@lumino/signaling';

import { INextSnapshot, matchesQuery, nextSnapshot } from './commits';
import { IGraphLayout, layoutGraph } from './layout';
import { asRequestError, InfinijupRequestError } from './errors';
import type {
  ICommit,
  IHead,
  IHistory,
  IInfinijupAPI,
  IOperationEvent
} from './types';

/** Which notebook the model shows. */
export interface IHistoryTarget {
  /** The notebook path (the history belongs to it). */
  path: string;
  /** The notebook's kernel, if it has one. */
  kernelId: string | null;
}

export type HistoryState = 'empty' | 'loading' | 'ready' | 'error';

export class HistoryModel implements IDisposable {
  constructor(options: HistoryModel.IOptions) {
    this._api = options.api;
    this._refreshDelay = options.refreshDelay ?? 150;
    this._collapse = options.collapse ?? true;
    this._minRun = Math.max(2, options.minRun ?? 10);
    this._keepRecent = Math.max(0, options.keepRecent ?? 3);
  }

  /** Emitted on any change (history, state, selection, operation, layout). */
  get changed(): ISignal<this, HistoryModel.ChangeKind> {
    return this._changed;
  }

  get isDisposed(): boolean {
    return this._isDisposed;
  }

  get target(): IHistoryTarget | null {
    return this._target;
  }

  get state(): HistoryState {
    return this._state;
  }

  /** True while a request is in flight (also while showing older data). */
  get loading(): boolean {
    return this._loading;
  }

  get history(): IHistory | null {
    return this._history;
  }

  get commits(): readonly ICommit[] {
    return this._history?.commits ?? [];
  }

  get head(): IHead | null {
    return this._history?.head ?? null;
  }

  get threads(): { readonly [name: string]: string } {
    return this._history?.threads ?? {};
  }

  get error(): InfinijupRequestError | null {
    return this._error;
  }

  /** The operation running on the target's kernel (latest event), or null. */
  get operation(): IOperationEvent | null {
    return this._operation;
  }

  get selected(): string | null {
    return this._selected;
  }

  /** Whether long linear runs are collapsed. */
  get collapse(): boolean {
    return this._collapse;
  }
  set collapse(value: boolean) {
    if (value !== this._collapse) {
      this._collapse = value;
      this._invalidateLayout();
    }
  }

  /** Minimum length of a collapsed run. */
  get minRun(): number {
    return this._minRun;
  }
  set minRun(value: number) {
    value = Math.max(2, Math.floor(value));
    if (value !== this._minRun) {
      this._minRun = value;
      this._invalidateLayout();
    }
  }

  /**
   * Where the next snapshot of the target's kernel goes (null without a
   * kernel: a resumed kernel's head is decided by the server).
   */
  get nextSnapshot(): INextSnapshot | null {
    if (!this._history || !this._target?.kernelId) {
      return null;
    }
    const head = this.head;
    const commitThread = this.getCommit(head?.commit)?.thread;
    return nextSnapshot(head, this.threads, commitThread);
  }

  /** The search query ('' when none). */
  get query(): string {
    return this._query;
  }
  set query(value: string) {
    if (value !== this._query) {
      this._query = value;
      this._matches = null;
      this._invalidateLayout();
    }
  }

  /** Ids of the commits matching the query, newest first (null: no query). */
  get matches(): readonly string[] | null {
    if (!this._query.trim()) {
      return null;
    }
    if (!this._matches) {
      this._matches = this.commits
        .filter(c => matchesQuery(c, this._query))
        .map(c => c.id);
      this._matchSet = new Set(this._matches);
    }
    return this._matches;
  }

  /** Whether a commit matches the query (true when there is none). */
  isMatch(id: string): boolean {
    return this.matches === null || this._matchSet!.has(id);
  }

  /** The commit compared with the selected one, or null. */
  get compareWith(): string | null {
    return this._compareWith;
  }

  /** Compare the selected commit with another one (null: stop comparing). */
  setCompare(id: string | null): void {
    if (id === this._selected) {
      id = null;
    }
    if (id !== this._compareWith || this._picking) {
      this._compareWith = id;
      this._picking = false;
      this._emit('selection');
    }
  }

  /** True while the next row click picks the commit to compare with. */
  get picking(): boolean {
    return this._picking;
  }
  set picking(value: boolean) {
    if (value !== this._picking) {
      this._picking = value;
      this._emit('selection');
    }
  }

  /** The layout of the graph (computed lazily, cached until a change). */
  get layout(): IGraphLayout<ICommit> {
    if (!this._layout) {
      const pinned: string[] = Object.values(this.threads);
      const head = this.head?.commit;
      if (head) {
        pinned.push(head);
      }
      // Search results are never folded away.
      pinned.push(...(this.matches ?? []));
      this._layout = layoutGraph(this.commits, {
        collapse: this._collapse
          ? {
              minRun: this._minRun,
              keepRecent: this._keepRecent,
              expanded: this._expanded
            }
          : null,
        pinned
      });
    }
    return this._layout;
  }

  /** Commit id -> names of the threads whose tip it is. */
  get tips(): Map<string, string[]> {
    if (!this._tips) {
      this._tips = new Map();
      for (const [name, id] of Object.entries(this.threads)) {
        const names = this._tips.get(id) ?? [];
        names.push(name);
        this._tips.set(id, names);
      }
    }
    return this._tips;
  }

  /**
   * Find a commit by full id, unique id prefix (4+ hex digits) or thread name.
   */
  getCommit(ref: string | null | undefined): ICommit | undefined {
    if (!ref) {
      return undefined;
    }
    this._indexCommits();
    const exact = this._byId!.get(ref);
    if (exact) {
      return exact;
    }
    const tip = this.threads[ref];
    if (tip && this._byId!.has(tip)) {
      return this._byId!.get(tip);
    }
    if (/^[0-9a-f]{4,}$/i.test(ref)) {
      const lower = ref.toLowerCase();
      const found = this.commits.filter(c => c.id.startsWith(lower));
      if (found.length === 1) {
        return found[0];
      }
    }
    return undefined;
  }

  /** Show the history of another notebook (or of none). */
  setTarget(target: IHistoryTarget | null): void {
    const same =
      target === this._target ||
      (target !== null &&
        this._target !== null &&
        target.path === this._target.path &&
        target.kernelId === this._target.kernelId);
    if (same) {
      return;
    }
    const pathChanged = target?.path !== this._target?.path;
    this._target = target ? { ...target } : null;
    this._operation = null;
    if (pathChanged) {
      this._history = null;
      this._error = null;
      this._selected = null;
      this._compareWith = null;
      this._picking = false;
      this._expanded = new Set();
      this._invalidateCaches();
      this._state = target ? 'loading' : 'empty';
    }
    this._emit('target');
    if (target) {
      void this.refresh();
    }
  }

  /** Reload the history from the server. */
  async refresh(): Promise<void> {
    this._clearScheduled();
    const target = this._target;
    if (!target || this._isDisposed) {
      return;
    }
    const seq = ++this._seq;
    this._loading = true;
    if (!this._history) {
      this._state = 'loading';
    }
    this._emit('state');
    try {
      const history = await this._api.history(
        target.kernelId ? { kernel_id: target.kernelId } : { path: target.path }
      );
      if (seq !== this._seq || this._isDisposed) {
        return;
      }
      this._history = history;
      this._error = null;
      this._state = 'ready';
      if (this._selected && !this.getCommit(this._selected)) {
        this._selected = null;
      }
      if (this._compareWith && !this.getCommit(this._compareWith)) {
        this._compareWith = null;
      }
      this._invalidateCaches();
    } catch (error) {
      if (seq !== this._seq || this._isDisposed) {
        return;
      }
      this._error = asRequestError(error);
      this._state = 'error';
    } finally {
      if (seq === this._seq && !this._isDisposed) {
        this._loading = false;
        this._emit('history');
      }
    }
  }

  /** Whether an operation event concerns the target notebook. */
  isTargetEvent(event: IOperationEvent): boolean {
    const target = this._target;
    if (!target) {
      return false;
    }
    return (
      (!!target.kernelId && event.kernel_id === target.kernelId) ||
      (!!event.path && event.path === target.path)
    );
  }

  /**
   * Take an operation event from the event bus. Events of other notebooks are
   * ignored; a finished snapshot or restore reloads the history (debounced).
   */
  handleEvent(event: IOperationEvent): void {
    if (this._isDisposed || !this.isTargetEvent(event)) {
      return;
    }
    if (event.phase === 'done' || event.phase === 'error') {
      if (!this._operation || this._operation.op_id === event.op_id) {
        this._operation = null;
      }
      if (event.phase === 'done') {
        if (
          event.op === 'restore' &&
          event.commit &&
          this._history &&
          this._target?.kernelId === event.kernel_id
        ) {
          // Show the new head at once; the reload confirms it. An empty
          // thread means the next snapshot starts a new one.
          this._history = {
            ...this._history,
            head: {
              thread: event.thread || null,
              commit: event.commit,
              next_thread: null
            }
          };
          this._invalidateCaches();
        }
        this.scheduleRefresh();
      }
    } else {
      this._operation = event;
    }
    this._emit('operation');
  }

  /** Reload soon, coalescing bursts of events. */
  scheduleRefresh(): void {
    if (this._scheduled !== null) {
      return;
    }
    this._scheduled = setTimeout(() => {
      this._scheduled = null;
      void this.refresh();
    }, this._refreshDelay);
  }

  /**
   * Select a commit (or a collapsed node id) or nothing. While picking a
   * commit to compare with, the commit becomes the compared one instead.
   */
  select(id: string | null): void {
    if (this._picking && id && this.getCommit(id)) {
      this.setCompare(id);
      return;
    }
    if (id !== this._selected) {
      this._selected = id;
      this._compareWith = null;
      this._picking = false;
      this._emit('selection');
    }
  }

  /** Expand the collapsed run with this key. */
  expand(key: string): void {
    if (!this._expanded.has(key)) {
      this._expanded.add(key);
      this._invalidateLayout();
    }
  }

  /** Make a commit visible: expand the run that hides it. Returns its row. */
  reveal(id: string): number | undefined {
    const layout = this.layout;
    const row = layout.rowOf.get(id);
    if (row === undefined) {
      return undefined;
    }
    const node = layout.rows[row].node;
    if (node.kind === 'collapsed') {
      this.expand(node.key);
      return this.layout.rowOf.get(id);
    }
    return row;
  }

  /** Collapse every run again. */
  collapseAll(): void {
    if (this._expanded.size > 0) {
      this._expanded = new Set();
      this._invalidateLayout();
    }
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    this._clearScheduled();
    Signal.clearData(this);
  }

  private _indexCommits(): void {
    if (!this._byId) {
      this._byId = new Map(this.commits.map(c => [c.id, c]));
    }
  }

  private _invalidateCaches(): void {
    this._byId = null;
    this._tips = null;
    this._layout = null;
    this._matches = null;
  }

  private _invalidateLayout(): void {
    this._layout = null;
    this._emit('layout');
  }

  private _clearScheduled(): void {
    if (this._scheduled !== null) {
      clearTimeout(this._scheduled);
      this._scheduled = null;
    }
  }

  private _emit(kind: HistoryModel.ChangeKind): void {
    if (!this._isDisposed) {
      this._changed.emit(kind);
    }
  }

  private _api: IInfinijupAPI;
  private _refreshDelay: number;
  private _collapse: boolean;
  private _minRun: number;
  private _keepRecent: number;
  private _target: IHistoryTarget | null = null;
  private _state: HistoryState = 'empty';
  private _loading = false;
  private _history: IHistory | null = null;
  private _error: InfinijupRequestError | null = null;
  private _operation: IOperationEvent | null = null;
  private _selected: string | null = null;
  private _compareWith: string | null = null;
  private _picking = false;
  private _query = '';
  private _matches: string[] | null = null;
  private _matchSet: Set<string> | null = null;
  private _expanded = new Set<string>();
  private _layout: IGraphLayout<ICommit> | null = null;
  private _byId: Map<string, ICommit> | null = null;
  private _tips: Map<string, string[]> | null = null;
  private _seq = 0;
  private _scheduled: ReturnType<typeof setTimeout> | null = null;
  private _isDisposed = false;
  private _changed = new Signal<this, HistoryModel.ChangeKind>(this);
}

export namespace HistoryModel {
  export interface IOptions {
    api: IInfinijupAPI;
    /** Delay before reloading after an event, in ms (default 150). */
    refreshDelay?: number;
    /** Collapse long linear runs (default true). */
    collapse?: boolean;
    /** Minimum length of a collapsed run (default 10). */
    minRun?: number;
    /** Newest commits of a run kept visible (default 3). */
    keepRecent?: number;
  }

  export type ChangeKind =
    'target' | 'state' | 'history' | 'operation' | 'selection' | 'layout';
}
