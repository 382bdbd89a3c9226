/**
 * Getting space back in the panel: the sizes line, what a delete would do
 * (asked before it runs), the delete calls and their answers (409 says why),
 * and the panel's delete buttons and commands (refresh after a delete).
 */

jest.mock('@jupyterlab/apputils', () => ({
  Clipboard: { copyToSystem: jest.fn() },
  Dialog: {},
  InputDialog: {},
  Notification: {},
  showDialog: jest.fn()
}));

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
  class CommandToolbarButton extends Widget {}
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
import { InfinijupRequestError } from '../src/errors';
import { ManagedKernels } from '../src/kernels';
import { HistoryModel } from '../src/model';
import {
  DELETE_SNAPSHOT_COMMAND,
  DELETE_THREAD_COMMAND,
  HistoryPanel
} from '../src/panel';
import { formatBytes } from '../src/format';
import { ProgressTracker } from '../src/progress';
import {
  deleteSnapshotQuestion,
  deleteThreadQuestion,
  onlyOnThread,
  snapshotDeletion,
  SpaceActions,
  spaceLine
} from '../src/restActions';
import type {
  IDeleteRequest,
  IDeleteResult,
  IHistory,
  ISpaceAPI,
  ISpaceStats
} from '../src/types';
import {
  FakeAPI,
  fakeKernel,
  fakeNotebook,
  FakeNotifier,
  fakeTracker,
  flush
} from './fakes';
import { commit } from './synthetic';

const A = 'a'.repeat(64);
const B = 'b'.repeat(64);
const C = 'c'.repeat(64);
const D = 'd'.repeat(64);

/** main: A <- B (tip); side: A <- C <- D (tip). */
function history(): IHistory {
  return {
    commits: [
      commit(D, [C], 'side', 4),
      commit(C, [A], 'side', 3),
      commit(B, [A], 'main', 2),
      commit(A, [], 'main', 1)
    ],
    threads: { main: B, side: D },
    head: { thread: 'main', commit: B, next_thread: 'main' }
  };
}

const STATS: ISpaceStats = {
  store_bytes: 45_000_000,
  commits: 4,
  threads: 2,
  hot_bytes: 2_700_000_000,
  hot_entries: 3,
  hot_budget: 8e9,
  text: 'Store 42.9 MiB · hot copies 2.51 GiB'
};

class FakeSpaceAPI implements ISpaceAPI {
  stats: ISpaceStats | null = STATS;
  failure: InfinijupRequestError | null = null;
  deleteFromHistory = jest.fn(
    async (body: IDeleteRequest): Promise<IDeleteResult> => {
      if (this.failure) {
        throw this.failure;
      }
      return {
        path: body.path ?? 'nb.ipynb',
        commit: body.commit ?? null,
        thread: body.thread ?? null,
        threads: {},
        removed: [body.commit ?? ''],
        store_bytes: 30_000_000,
        freed_bytes: 15_000_000,
        hot_dropped: 1,
        hot_freed_bytes: 1_200_000_000
      };
    }
  );
  spaceStats = jest.fn(async () => {
    if (!this.stats) {
      throw new InfinijupRequestError('down', 'network_error', 0);
    }
    return this.stats;
  });
}

describe('sizes', () => {
  it('are in binary units, as everywhere in the UI', () => {
    expect(formatBytes(45_000_000)).toBe('42.9 MiB');
    expect(formatBytes(2_700_000_000)).toBe('2.51 GiB');
    expect(formatBytes(null)).toBe('–');
  });

  it('make the header line, without the hot tier when unknown', () => {
    expect(spaceLine(STATS)).toBe('Store 42.9 MiB · hot copies 2.51 GiB');
    expect(spaceLine({ ...STATS, hot_bytes: null })).toBe('Store 42.9 MiB');
    expect(spaceLine(null)).toBe('');
  });
});

describe('what a delete would do', () => {
  it('moves a tip back, refuses a snapshot with children', () => {
    const h = history();
    expect(snapshotDeletion(h, B)).toEqual({
      children: [],
      moves: { main: A }
    });
    expect(deleteSnapshotQuestion(h, B)).toContain(
      'Thread main moves back to aaaaaaaa.'
    );
    expect(snapshotDeletion(h, A).children.sort()).toEqual([B, C].sort());
    expect(deleteSnapshotQuestion(h, A)).toBeNull();
    const single = {
      commits: [commit(A, [], 'main', 1)],
      threads: { main: A }
    };
    expect(deleteSnapshotQuestion(single, A)).toContain(
      'Thread main has nothing left and is removed.'
    );
  });

  it('counts the snapshots only a thread has', () => {
    const h = history();
    expect(onlyOnThread(h, 'side').sort()).toEqual([C, D].sort());
    expect(onlyOnThread(h, 'main')).toEqual([B]);
    expect(deleteThreadQuestion(h, 'side')).toBe(
      'Delete thread side? 2 snapshots only this thread has go with it. This cannot be undone.'
    );
  });
});

describe('SpaceActions', () => {
  const target = { path: 'nb.ipynb', kernelId: 'k1' };

  it('asks, deletes, and says what was freed', async () => {
    const api = new FakeSpaceAPI();
    const notifier = new FakeNotifier();
    const confirm = jest.fn(async () => true);
    const actions = new SpaceActions(api, notifier, confirm);
    const done = await actions.deleteSnapshot(target, history(), B);
    expect(confirm).toHaveBeenCalledWith(
      'Delete snapshot',
      expect.stringContaining('Delete snapshot bbbbbbbb?'),
      'Delete'
    );
    expect(api.deleteFromHistory).toHaveBeenCalledWith({
      kernel_id: 'k1',
      commit: B
    });
    expect(done?.freed_bytes).toBe(15_000_000);
    expect(notifier.notes[0]).toMatchObject({
      type: 'success',
      message:
        'Delete of snapshot bbbbbbbb: 14.3 MiB freed and 1.12 GiB of hot copies.'
    });
  });

  it('does nothing when declined, and never asks about a snapshot with children', async () => {
    const api = new FakeSpaceAPI();
    const notifier = new FakeNotifier();
    const confirm = jest.fn(async () => false);
    const actions = new SpaceActions(api, notifier, confirm);
    expect(await actions.deleteThread(target, history(), 'side')).toBeNull();
    expect(await actions.deleteSnapshot(target, history(), A)).toBeNull();
    expect(confirm).toHaveBeenCalledTimes(1);
    expect(api.deleteFromHistory).not.toHaveBeenCalled();
    expect(notifier.notes[0].message).toContain(
      '2 later snapshots build on it'
    );
  });

  it('shows the reason of a refusal (409) as a warning', async () => {
    const api = new FakeSpaceAPI();
    api.failure = new InfinijupRequestError(
      'thread side cannot be deleted: dddddddd is the snapshot kernel k2 is hibernated in',
      'snapshot_in_use',
      409
    );
    const notifier = new FakeNotifier();
    const actions = new SpaceActions(api, notifier, async () => true);
    expect(
      await actions.deleteThread(
        { path: 'nb.ipynb', kernelId: null },
        history(),
        'side'
      )
    ).toBeNull();
    expect(api.deleteFromHistory).toHaveBeenCalledWith({
      path: 'nb.ipynb',
      thread: 'side'
    });
    expect(notifier.notes[0].type).toBe('warning');
    expect(notifier.notes[0].message).toContain('hibernated');
    expect(notifier.notes[0].message).toContain('snapshot_in_use');
  });
});

describe('HistoryPanel deletes', () => {
  function setup(confirmed = true) {
    const api = new FakeAPI(history());
    const spaceApi = new FakeSpaceAPI();
    const notifier = new FakeNotifier();
    const space = new SpaceActions(spaceApi, notifier, async () => confirmed);
    const notebook = fakeNotebook(fakeKernel('k1'));
    const commands = new CommandRegistry();
    const model = new HistoryModel({ api, refreshDelay: 0 });
    const actions = new InfinijupActions({
      api,
      tracker: fakeTracker(notebook),
      managed: new ManagedKernels(api),
      progress: new ProgressTracker({ notifier, settleMs: 0 }),
      model,
      settings: () => DEFAULT_SETTINGS
    });
    const panel = new HistoryPanel({ model, actions, commands, space });
    Widget.attach(panel, document.body);
    panel.setNotebook(notebook);
    return { api, spaceApi, model, panel, commands };
  }

  afterEach(() => {
    document.body.innerHTML = '';
  });

  it('shows the sizes in the header', async () => {
    const { panel, spaceApi } = setup();
    await flush();
    await flush();
    expect(spaceApi.spaceStats).toHaveBeenCalled();
    expect(panel.node.querySelector('.jp-Infinijup-space')?.textContent).toBe(
      'Store 42.9 MiB · hot copies 2.51 GiB'
    );
  });

  it('deletes the selected snapshot from its card, then refreshes', async () => {
    const { api, spaceApi, model, panel } = setup();
    await flush();
    model.select(D);
    const labels = Array.from(
      panel.node.querySelectorAll('.jp-Infinijup-delete button')
    ).map(b => b.textContent);
    expect(labels).toEqual(['Delete snapshot', 'Delete thread side']);
    const calls = api.history.mock.calls.length;
    api.after = {
      ...history(),
      commits: history().commits.filter(c => c.id !== D),
      threads: { main: B, side: C }
    };
    panel.node
      .querySelector<HTMLButtonElement>('[data-delete="snapshot"]')!
      .click();
    await flush();
    await flush();
    expect(spaceApi.deleteFromHistory).toHaveBeenCalledWith({
      kernel_id: 'k1',
      commit: D
    });
    expect(api.history.mock.calls.length).toBeGreaterThan(calls);
    expect(model.getCommit(D)).toBeUndefined();
    expect(model.selected).toBeNull();
  });

  it('has commands for the rows context menu', async () => {
    const { spaceApi, model, commands } = setup();
    await flush();
    model.select(C);
    expect(commands.label(DELETE_SNAPSHOT_COMMAND, {})).toBe(
      'Delete Snapshot cccccccc…'
    );
    expect(commands.label(DELETE_THREAD_COMMAND, {})).toBe(
      'Delete Thread side…'
    );
    expect(commands.isEnabled(DELETE_SNAPSHOT_COMMAND, {})).toBe(true);
    await commands.execute(DELETE_THREAD_COMMAND, {});
    expect(spaceApi.deleteFromHistory).toHaveBeenCalledWith({
      kernel_id: 'k1',
      thread: 'side'
    });
  });

  it('does not delete when the person declines', async () => {
    const { spaceApi, model, panel } = setup(false);
    await flush();
    model.select(B);
    panel.node
      .querySelector<HTMLButtonElement>('[data-delete="thread"]')!
      .click();
    await flush();
    expect(spaceApi.deleteFromHistory).not.toHaveBeenCalled();
  });
});
