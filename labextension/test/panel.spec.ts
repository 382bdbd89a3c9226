/**
 * The Kernel history panel in jsdom: what it says for each kind of kernel,
 * where the next snapshot goes, the commit card (variables, comparison,
 * actions), search and the fold toggle.
 */

jest.mock('@jupyterlab/apputils', () => ({
  Clipboard: { copyToSystem: jest.fn() },
  Dialog: {},
  InputDialog: {},
  Notification: {},
  showDialog: jest.fn()
}));

// The real toolbar pulls in ES-module web components jest does not load.
jest.mock('@jupyterlab/ui-components', () => {
  const { Widget } = jest.requireActual('@lumino/widgets');
  class Toolbar extends Widget {
    addItem(_: string, item: any): boolean {
      this.node.appendChild(item.node);
      return true;
    }
    static createSpacerItem(): any {
      return new Widget();
    }
  }
  class CommandToolbarButton extends Widget {
    constructor(options: { label?: string }) {
      super();
      this.node.textContent = options.label ?? '';
    }
  }
  class LabIcon {
    constructor(options: object) {
      Object.assign(this, options);
    }
  }
  return { Toolbar, CommandToolbarButton, LabIcon, refreshIcon: {} };
});

import { CommandRegistry } from '@lumino/commands';
import { Widget } from '@lumino/widgets';

import { DEFAULT_SETTINGS, InfinijupActions } from '../src/actions';
import { CommandIDs } from '../src/commandids';
import { ManagedKernels } from '../src/kernels';
import { HistoryModel } from '../src/model';
import { CHANGE_KERNEL_COMMAND, HistoryPanel } from '../src/panel';
import { ProgressTracker } from '../src/progress';
import type { ICommit, IHistory, IVariableInfo } from '../src/types';
import {
  FakeAPI,
  fakeKernel,
  fakeNotebook,
  FakeNotifier,
  fakeTracker,
  flush
} from './fakes';
import { commit } from './synthetic';

function v(name: string, fp: string, changed: boolean): IVariableInfo {
  return { name, type: 'int', size: 28, shape: null, fp, changed };
}

function described(
  id: string,
  parents: string[],
  created: number,
  source: string,
  items: IVariableInfo[]
): ICommit {
  const c = commit(id, parents, 'main', created);
  c.message = '';
  c.metadata = {
    cell: { execution_count: created, source },
    variables: { items, truncated: false }
  };
  return c;
}

/** main: a <- b <- c (tip); HEAD at a (restored: the next one starts main-1). */
function history(): IHistory {
  return {
    commits: [
      described('c'.repeat(64), ['b'.repeat(64)], 3, 'model = fit(df)', [
        v('df', '2', false),
        v('model', '3', true)
      ]),
      described('b'.repeat(64), ['a'.repeat(64)], 2, 'df = load()', [
        v('df', '2', true),
        v('tmp', '9', false)
      ]),
      commit('a'.repeat(64), [], 'main', 1, 'start')
    ],
    threads: { main: 'c'.repeat(64) },
    head: { thread: null, commit: 'a'.repeat(64), next_thread: 'main-1' }
  };
}

function setup(
  kernel: ReturnType<typeof fakeKernel> | null,
  h: IHistory = history()
) {
  const api = new FakeAPI(h);
  const notebook = fakeNotebook(kernel);
  const commands = new CommandRegistry();
  const model = new HistoryModel({ api, refreshDelay: 0 });
  const executed: [string, any][] = [];
  for (const id of [
    CommandIDs.snapshot,
    CommandIDs.refresh,
    CommandIDs.restore,
    CommandIDs.branch,
    CommandIDs.resume,
    CommandIDs.openInNewNotebook,
    CommandIDs.copyId,
    CHANGE_KERNEL_COMMAND
  ]) {
    commands.addCommand(id, {
      label: id,
      execute: args => {
        executed.push([id, args]);
      }
    });
  }
  commands.addCommand(CommandIDs.toggleCollapse, {
    label: 'Fold runs',
    execute: () => {
      model.collapse = !model.collapse;
    }
  });
  const actions = new InfinijupActions({
    api,
    tracker: fakeTracker(notebook),
    managed: new ManagedKernels(api),
    progress: new ProgressTracker({
      notifier: new FakeNotifier(),
      settleMs: 0
    }),
    model,
    settings: () => DEFAULT_SETTINGS
  });
  const panel = new HistoryPanel({ model, actions, commands });
  Widget.attach(panel, document.body);
  panel.setNotebook(notebook);
  return { api, notebook, model, panel, executed };
}

function text(panel: HistoryPanel, selector: string): string {
  return panel.node.querySelector(selector)?.textContent ?? '';
}

function buttons(panel: HistoryPanel): string[] {
  return Array.from(
    panel.node.querySelectorAll<HTMLButtonElement>(
      '.jp-Infinijup-details [data-action]'
    )
  )
    .filter(b => !b.classList.contains('jp-Infinijup-close'))
    .map(b => b.textContent!);
}

afterEach(() => {
  document.body.innerHTML = '';
});

describe('HistoryPanel', () => {
  it('says where the next snapshot goes after restoring an older commit', async () => {
    const { panel } = setup(fakeKernel('k1'));
    await flush();
    expect(text(panel, '.jp-Infinijup-headline')).toBe(
      'HEAD aaaaaaaa (not a thread tip) · next snapshot starts new thread main-1'
    );
    expect(panel.node.dataset.kernel).toBe('managed');
  });

  it('says a fresh kernel starts a new root (issue 28, item 4)', async () => {
    const h = history();
    const { panel } = setup(fakeKernel('k1'), {
      ...h,
      head: { thread: 'main', commit: null, next_thread: 'main-1' }
    });
    await flush();
    expect(text(panel, '.jp-Infinijup-headline')).toBe(
      'Fresh kernel · next snapshot starts new root main-1'
    );
  });

  it('marks a commit of another notebook, the one its kernel came from', async () => {
    const h = history();
    const { panel, model } = setup(fakeKernel('k1'), {
      ...h,
      commits: h.commits.map(c => ({ ...c, notebook: 'other/origin.ipynb' }))
    });
    await flush();
    model.select(h.commits[0].id);
    await flush();
    expect(text(panel, '.jp-Infinijup-elsewhere')).toBe(
      'A snapshot of other/origin.ipynb: this kernel came from it'
    );
  });

  it('on a kernel it does not manage shows only how to switch kernels', async () => {
    const { api, panel, executed } = setup(fakeKernel('py-1', 'python3'), {
      commits: [],
      threads: {},
      head: null
    });
    await flush();
    expect(api.history).toHaveBeenCalled();
    expect(panel.node.dataset.state).toBe('ready');
    const status = text(panel, '.jp-Infinijup-status');
    expect(status).toContain('is not managed by Infinijup');
    expect(status).toContain('Python 3 (ipykernel)');
    expect(status).toContain('Kernel › Change Kernel…');
    expect(status).not.toContain('Press Snapshot');
    expect(status).not.toContain('%snapshot');
    panel.node
      .querySelector<HTMLButtonElement>('.jp-Infinijup-change-kernel')!
      .click();
    expect(executed.map(e => e[0])).toEqual([CHANGE_KERNEL_COMMAND]);
  });

  it('without a kernel shows the history with Resume here and Open in new notebook', async () => {
    const { api, panel, model, executed } = setup(null);
    await flush();
    expect(api.history).toHaveBeenCalledWith({ path: 'nb.ipynb' });
    expect(text(panel, '.jp-Infinijup-status')).toContain(
      'No kernel is running'
    );
    expect(panel.node.querySelector('.jp-Infinijup-headline')).toBeNull();
    expect(panel.node.querySelectorAll('.jp-Infinijup-row')).toHaveLength(3);
    model.select('b'.repeat(64));
    expect(buttons(panel)).toEqual([
      'Resume here',
      'Open in new notebook',
      'Compare…',
      'Copy id'
    ]);
    panel.node
      .querySelector<HTMLButtonElement>('[data-action="resume"]')!
      .click();
    panel.node
      .querySelector<HTMLButtonElement>('[data-action="open-new"]')!
      .click();
    expect(executed).toEqual([
      [CommandIDs.resume, { commit: 'b'.repeat(64), notebookId: 'notebook-1' }],
      [
        CommandIDs.openInNewNotebook,
        { commit: 'b'.repeat(64), notebookId: 'notebook-1' }
      ]
    ]);
  });

  it('disables resuming a commit the server marks not resumable', async () => {
    const { api, panel, model } = setup(null);
    api.current.commits[0].resumable = false;
    api.current.commits[0].resumable_reason = 'other GPUs';
    await flush();
    model.select('c'.repeat(64));
    const resume = panel.node.querySelector<HTMLButtonElement>(
      '[data-action="resume"]'
    )!;
    expect(resume.disabled).toBe(true);
    expect(text(panel, '.jp-Infinijup-warning')).toBe(
      'Cannot be resumed here: other GPUs'
    );
  });

  it('labels rows by their cell and lists the changed variables', async () => {
    const { panel, model } = setup(fakeKernel('k1'));
    await flush();
    const rows = Array.from(
      panel.node.querySelectorAll('.jp-Infinijup-row-message')
    ).map(r => r.textContent);
    expect(rows).toEqual(['[3] model = fit(df)', '[2] df = load()', 'start']);
    model.select('b'.repeat(64));
    expect(buttons(panel)).toEqual([
      'Restore',
      'Branch from here',
      'Open in new notebook',
      'Compare…',
      'Copy id'
    ]);
    expect(text(panel, '.jp-Infinijup-details-title')).toBe('[2] df = load()');
    const changed = Array.from(
      panel.node.querySelectorAll(
        '.jp-Infinijup-vars > .jp-Infinijup-vartable tr'
      )
    ).map(r => r.getAttribute('data-var'));
    expect(changed).toEqual(['df']);
    expect(text(panel, '.jp-Infinijup-vars .jp-Infinijup-section')).toBe(
      'Changed variables (1 of 2, since its parent)'
    );
    // An older snapshot says its variables were not recorded.
    model.select('a'.repeat(64));
    expect(text(panel, '.jp-Infinijup-vars')).toContain('not recorded');
  });

  it('compares two commits: pick with Compare…, then a row', async () => {
    const { panel, model } = setup(fakeKernel('k1'));
    await flush();
    model.select('c'.repeat(64));
    panel.node
      .querySelector<HTMLButtonElement>('[data-action="compare"]')!
      .click();
    expect(model.picking).toBe(true);
    expect(text(panel, '.jp-Infinijup-picking')).toContain(
      'Click the commit to compare with cccccccc'
    );
    panel.node
      .querySelector<HTMLElement>(
        `.jp-Infinijup-row[data-commit-id="${'b'.repeat(64)}"]`
      )!
      .click();
    expect(model.selected).toBe('c'.repeat(64));
    expect(model.compareWith).toBe('b'.repeat(64));
    const diffs = Array.from(
      panel.node.querySelectorAll('.jp-Infinijup-diffs li')
    ).map(li => [li.getAttribute('data-kind'), li.textContent]);
    expect(diffs).toEqual([
      ['only-a', 'model only in cccccccc (int, 28 B)'],
      ['only-b', 'tmp only in bbbbbbbb (int, 28 B)']
    ]);
    expect(text(panel, '.jp-Infinijup-compare')).toContain(
      '2 differ, 1 identical.'
    );
    panel.node
      .querySelector<HTMLButtonElement>('[data-action="stop-compare"]')!
      .click();
    expect(model.compareWith).toBeNull();
    expect(panel.node.querySelector('.jp-Infinijup-compare')).toBeNull();
  });

  it('searches by variable name and steps through the matches', async () => {
    const { panel, model } = setup(fakeKernel('k1'));
    await flush();
    const input = panel.node.querySelector<HTMLInputElement>(
      '.jp-Infinijup-search input'
    )!;
    input.value = 'model';
    input.dispatchEvent(new Event('input'));
    expect(model.query).toBe('model');
    expect(text(panel, '.jp-Infinijup-search-count')).toBe('1 of 3');
    expect(
      panel.node.querySelectorAll('.jp-Infinijup-row.jp-mod-dimmed')
    ).toHaveLength(2);
    input.dispatchEvent(new KeyboardEvent('keydown', { key: 'Enter' }));
    expect(model.selected).toBe('c'.repeat(64));
    input.value = 'nothing-like-it';
    input.dispatchEvent(new Event('input'));
    expect(text(panel, '.jp-Infinijup-search-count')).toBe('no match');
    input.dispatchEvent(new KeyboardEvent('keydown', { key: 'Escape' }));
    expect(model.query).toBe('');
  });

  it('has a labelled fold toggle', async () => {
    const { panel, model } = setup(fakeKernel('k1'));
    await flush();
    const label = panel.node.querySelector('.jp-Infinijup-fold label')!;
    expect(label.textContent!.trim()).toBe('Fold runs');
    const box = label.querySelector('input')!;
    expect(box.checked).toBe(true);
    box.checked = false;
    box.dispatchEvent(new Event('change'));
    await flush();
    expect(model.collapse).toBe(false);
    expect(box.checked).toBe(false);
  });

  it('shows one row per cell with Cells, and a row selects its snapshot (issue 30)', async () => {
    const { panel, model } = setup(fakeKernel('k1'));
    await flush();
    const box = panel.node.querySelector<HTMLInputElement>(
      '.jp-Infinijup-cells-toggle input'
    )!;
    box.checked = true;
    box.dispatchEvent(new Event('change'));
    await flush();
    expect(panel.cellsShown).toBe(true);
    expect(panel.graph.isHidden).toBe(true);
    const rows = () =>
      Array.from(
        panel.node.querySelectorAll<HTMLElement>(
          '.jp-Infinijup-timeline [data-commit-id]'
        )
      );
    // HEAD is at a (restored): b and c were undone, Redo goes back there.
    expect(
      rows().map(r => [
        r.querySelector('.jp-Infinijup-cell-count')!.textContent,
        r.classList.contains('jp-mod-ahead'),
        r.classList.contains('jp-mod-head')
      ])
    ).toEqual([
      ['[3]', true, false],
      ['[2]', true, false],
      ['[ ]', false, true]
    ]);
    expect(rows()[0].textContent).toContain('model = fit(df)');
    expect(
      rows()[0].querySelector('.jp-Infinijup-cell-vars')!.textContent
    ).toBe('model');
    rows()[1].click();
    await flush();
    expect(model.selected).toBe('b'.repeat(64));
    expect(rows()[1].classList.contains('jp-mod-selected')).toBe(true);
    expect(buttons(panel)).toContain('Restore');

    // The search keeps the matching cells only (cell text, variable).
    const input = panel.node.querySelector<HTMLInputElement>(
      '.jp-Infinijup-search input'
    )!;
    input.value = 'load';
    input.dispatchEvent(new Event('input'));
    await flush();
    expect(rows().map(r => r.dataset.commitId)).toEqual(['b'.repeat(64)]);

    box.checked = false;
    box.dispatchEvent(new Event('change'));
    expect(panel.cellsShown).toBe(false);
    expect(panel.graph.isHidden).toBe(false);
  });
});
