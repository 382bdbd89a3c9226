/**
 * The body of the "pick a commit" dialog: a list of the notebook's commits
 * (HEAD preselected; each row shows its id, HEAD mark and age whole, the
 * label takes the rest of the line) and a field for a typed id, id prefix or
 * thread name.
 */

import { Widget } from '@lumino/widgets';

import { commitTitle } from './commits';
import { formatAge, shortId } from './format';
import { esc } from './graphview';
import type { ICommit } from './types';

export class CommitPicker extends Widget {
  constructor(options: CommitPicker.IOptions) {
    super();
    this.addClass('jp-Infinijup-picker');
    const commits = options.commits.slice(0, options.limit ?? 500);
    const head = options.head ?? null;

    const listLabel = document.createElement('div');
    listLabel.className = 'jp-Infinijup-picker-label';
    listLabel.textContent = commits.length
      ? 'Snapshots of this notebook (HEAD is where the kernel is now)'
      : 'This notebook has no snapshots yet.';
    this.node.appendChild(listLabel);

    this._list = document.createElement('div');
    this._list.className = 'jp-Infinijup-picker-list';
    this._list.tabIndex = 0;
    this._list.setAttribute('role', 'listbox');
    this._list.setAttribute('aria-label', 'Snapshots');
    this._list.innerHTML = commits
      .map(
        c =>
          `<div class="jp-Infinijup-picker-option" role="option" aria-selected="false" data-id="${esc(
            c.id
          )}" title="${esc(`${c.id}\n${commitTitle(c)}`)}">` +
          (c.id === head
            ? '<span class="jp-Infinijup-chip jp-Infinijup-chip-head">HEAD</span>'
            : '') +
          `<code class="jp-Infinijup-id">${shortId(c.id)}</code>` +
          `<span class="jp-Infinijup-picker-title">${esc(commitTitle(c))}</span>` +
          `<span class="jp-Infinijup-picker-age">${esc(formatAge(c.created))}</span></div>`
      )
      .join('');
    this._list.hidden = commits.length === 0;
    this.node.appendChild(this._list);

    const typedLabel = document.createElement('label');
    typedLabel.textContent = 'or type a commit id, id prefix or thread name';
    this._input = document.createElement('input');
    this._input.type = 'text';
    this._input.className = 'jp-mod-styled jp-Infinijup-picker-input';
    this._input.placeholder = 'e.g. main or 1a2b3c4d';
    this._input.spellcheck = false;
    typedLabel.appendChild(this._input);
    this.node.appendChild(typedLabel);

    const preselect = commits.find(c => c.id === head) ?? commits[0];
    if (preselect) {
      this._select(preselect.id);
    }
    this._list.addEventListener('click', this._onClick);
    this._list.addEventListener('dblclick', this._onDoubleClick);
    this._list.addEventListener('keydown', this._onKeyDown);
  }

  /** The typed ref, else the selected commit's id ('' when none). */
  getValue(): string {
    return this._input.value.trim() || this._selected;
  }

  /** The selected commit's id. */
  get selected(): string {
    return this._selected;
  }

  protected onAfterAttach(): void {
    this._options()
      .find(o => o.dataset.id === this._selected)
      ?.scrollIntoView({ block: 'nearest' });
  }

  private _options(): HTMLElement[] {
    return Array.from(
      this._list.querySelectorAll<HTMLElement>('.jp-Infinijup-picker-option')
    );
  }

  private _select(id: string): void {
    this._selected = id;
    for (const option of this._options()) {
      const on = option.dataset.id === id;
      option.setAttribute('aria-selected', on ? 'true' : 'false');
      option.classList.toggle('jp-mod-selected', on);
      if (on) {
        option.scrollIntoView?.({ block: 'nearest' });
      }
    }
  }

  private _onClick = (event: MouseEvent) => {
    const option = (event.target as HTMLElement).closest<HTMLElement>(
      '.jp-Infinijup-picker-option'
    );
    if (option?.dataset.id) {
      // Choosing from the list clears a typed ref: the two never disagree.
      this._input.value = '';
      this._select(option.dataset.id);
    }
  };

  private _onDoubleClick = (event: MouseEvent) => {
    this._onClick(event);
    this.node
      .closest('.jp-Dialog')
      ?.querySelector<HTMLButtonElement>('.jp-mod-accept')
      ?.click();
  };

  private _onKeyDown = (event: KeyboardEvent) => {
    const ids = this._options().map(o => o.dataset.id!);
    const at = ids.indexOf(this._selected);
    let next = at;
    switch (event.key) {
      case 'ArrowDown':
        next = Math.min(ids.length - 1, at + 1);
        break;
      case 'ArrowUp':
        next = Math.max(0, at - 1);
        break;
      case 'Home':
        next = 0;
        break;
      case 'End':
        next = ids.length - 1;
        break;
      default:
        return;
    }
    event.preventDefault();
    event.stopPropagation();
    if (next >= 0 && ids[next]) {
      this._input.value = '';
      this._select(ids[next]);
    }
  };

  private _list: HTMLElement;
  private _input: HTMLInputElement;
  private _selected = '';
}

export namespace CommitPicker {
  export interface IOptions {
    /** Newest first. */
    commits: readonly ICommit[];
    /** The kernel's HEAD commit, preselected. */
    head?: string | null;
    /** Most commits listed (default 500). */
    limit?: number;
  }
}
