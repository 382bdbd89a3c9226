/**
 * The body of the "pick a commit" dialog: a list of the notebook's commits
 * (HEAD preselected, each row whole: short id, label, age) and a field for a
 * typed id, id prefix or thread name.
 */

import { Widget } from '@lumino/widgets';

import { commitTitle } from './commits';
import { formatAge, shortId } from './format';
import type { ICommit } from './types';

/** Longest label shown in the list (the dialog is 560 px wide). */
const MAX_LABEL = 44;

export class CommitPicker extends Widget {
  constructor(options: CommitPicker.IOptions) {
    super();
    this.addClass('jp-Infinijup-picker');
    const commits = options.commits.slice(0, options.limit ?? 500);
    const head = options.head ?? null;

    const listLabel = document.createElement('label');
    listLabel.textContent = commits.length
      ? 'Snapshots of this notebook (HEAD is where the kernel is now)'
      : 'This notebook has no snapshots yet.';
    this.node.appendChild(listLabel);

    this._list = document.createElement('select');
    this._list.className = 'jp-Infinijup-picker-list';
    this._list.size = Math.max(2, Math.min(8, commits.length));
    this._list.setAttribute('aria-label', 'Snapshots');
    for (const c of commits) {
      const option = document.createElement('option');
      option.value = c.id;
      option.textContent = pickerLabel(c, c.id === head);
      option.title = `${c.id}\n${commitTitle(c)}`;
      this._list.appendChild(option);
    }
    const preselect = commits.find(c => c.id === head) ?? commits[0];
    if (preselect) {
      this._list.value = preselect.id;
    }
    if (commits.length === 0) {
      this._list.hidden = true;
    }
    this.node.appendChild(this._list);

    const typedLabel = document.createElement('label');
    typedLabel.textContent = 'or type a commit id, id prefix or thread name';
    this.node.appendChild(typedLabel);
    this._input = document.createElement('input');
    this._input.type = 'text';
    this._input.className = 'jp-mod-styled jp-Infinijup-picker-input';
    this._input.placeholder = 'e.g. main or 1a2b3c4d';
    this._input.spellcheck = false;
    this.node.appendChild(this._input);

    // Choosing from the list clears a typed ref, so the two never disagree.
    this._list.addEventListener('change', () => (this._input.value = ''));
    this._list.addEventListener('dblclick', () => {
      this.node
        .closest('.jp-Dialog')
        ?.querySelector<HTMLButtonElement>('.jp-mod-accept')
        ?.click();
    });
  }

  /** The typed ref, else the selected commit's id ('' when none). */
  getValue(): string {
    return this._input.value.trim() || this._list.value || '';
  }

  /** Focus the list (what the dialog focuses first). */
  focus(): void {
    (this._list.hidden ? this._input : this._list).focus();
  }

  private _list: HTMLSelectElement;
  private _input: HTMLInputElement;
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

/** "HEAD · 1a2b3c4d · [3] df = load() · 5 min ago" */
export function pickerLabel(commit: ICommit, isHead = false): string {
  const title = commitTitle(commit);
  return [
    ...(isHead ? ['HEAD'] : []),
    shortId(commit.id),
    title.length > MAX_LABEL ? title.slice(0, MAX_LABEL - 1) + '…' : title,
    formatAge(commit.created)
  ]
    .filter(Boolean)
    .join(' · ');
}
