/**
 * The user-facing operations with the dialogs and notifications mocked: what
 * they say, in which order they check and ask, what they send.
 */

jest.mock('@jupyterlab/apputils', () => ({
  Clipboard: { copyToSystem: jest.fn() },
  Dialog: {
    cancelButton: (o: any = {}) => ({ accept: false, label: 'Cancel', ...o }),
    okButton: (o: any = {}) => ({ accept: true, label: 'OK', ...o }),
    warnButton: (o: any = {}) => ({ accept: true, label: 'OK', ...o })
  },
  InputDialog: { getText: jest.fn() },
  Notification: {
    warning: jest.fn(),
    error: jest.fn(),
    info: jest.fn(),
    success: jest.fn()
  },
  showDialog: jest.fn()
}));

import { InputDialog, Notification, showDialog } from '@jupyterlab/apputils';

import { DEFAULT_SETTINGS, InfinijupActions } from '../src/actions';
import { ManagedKernels } from '../src/kernels';
import { HistoryModel } from '../src/model';
import { CommitPicker } from '../src/picker';
import { ProgressTracker } from '../src/progress';
import type { IHistory } from '../src/types';
import {
  FakeAPI,
  fakeKernel,
  fakeNotebook,
  FakeNotifier,
  fakeTracker,
  flush
} from './fakes';
import { commit } from './synthetic';

const ID = (n: number) => `${n}`.repeat(64).slice(0, 64);

/** main: 1 <- 2 <- 3 (tip, HEAD). */
function history(): IHistory {
  const c1 = commit(ID(1), [], 'main', 1);
  c1.message = '';
  c1.metadata = { cell: { execution_count: 1, source: 'x = 1' } };
  return {
    commits: [
      commit(ID(3), [ID(2)], 'main', 3, 'third'),
      commit(ID(2), [ID(1)], 'main', 2, 'second'),
      c1
    ],
    threads: { main: ID(3) },
    head: { thread: 'main', commit: ID(3), next_thread: 'main' }
  };
}

const mocked = {
  showDialog: showDialog as jest.Mock,
  getText: InputDialog.getText as jest.Mock,
  warning: Notification.warning as jest.Mock,
  error: Notification.error as jest.Mock,
  success: Notification.success as jest.Mock
};

function setup(kernel: ReturnType<typeof fakeKernel> | null) {
  const api = new FakeAPI(history());
  const panel = fakeNotebook(kernel);
  const notifier = new FakeNotifier();
  const openNotebook = jest.fn(async () => undefined);
  const changeKernel = jest.fn();
  const actions = new InfinijupActions({
    api,
    tracker: fakeTracker(panel),
    managed: new ManagedKernels(api),
    progress: new ProgressTracker({ notifier, settleMs: 0 }),
    model: new HistoryModel({ api, refreshDelay: 0 }),
    settings: () => DEFAULT_SETTINGS,
    openNotebook,
    changeKernel
  });
  return { api, panel, notifier, actions, openNotebook, changeKernel };
}

/** Answer the next dialogs: accept (true) or cancel (false). */
function answerDialogs(...answers: boolean[]) {
  for (const accept of answers) {
    mocked.showDialog.mockImplementationOnce(async (options: any) => ({
      button: { accept },
      value: options.body?.getValue?.() ?? null,
      isChecked: false
    }));
  }
}

beforeEach(() => jest.clearAllMocks());

describe('snapshot', () => {
  it('on a kernel Infinijup does not manage says why and does nothing', async () => {
    const { api, panel, actions, changeKernel } = setup(
      fakeKernel('py-1', 'python3')
    );
    expect(await actions.snapshot(panel)).toBeNull();
    expect(api.snapshot).not.toHaveBeenCalled();
    expect(mocked.warning).toHaveBeenCalledTimes(1);
    const [message, options] = mocked.warning.mock.calls[0];
    expect(message).toContain('not managed by Infinijup');
    expect(message).toContain('Python 3 (ipykernel)');
    expect(message).toContain('Python 3 (Infinijup)');
    // The notification offers to change the kernel.
    options.actions[0].callback();
    expect(changeKernel).toHaveBeenCalledWith(panel);
  });

  it('without a kernel says so', async () => {
    const { api, panel, actions } = setup(null);
    expect(await actions.snapshot(panel)).toBeNull();
    expect(api.snapshot).not.toHaveBeenCalled();
    expect(mocked.warning.mock.calls[0][0]).toContain('has no kernel running');
  });
});

describe('restore', () => {
  it('checks that the commit exists before asking for confirmation', async () => {
    const { api, panel, actions } = setup(fakeKernel('k1'));
    expect(await actions.restore(panel, 'deadbeefdead')).toBeNull();
    expect(mocked.showDialog).not.toHaveBeenCalled();
    expect(api.restore).not.toHaveBeenCalled();
    expect(mocked.error.mock.calls[0][0]).toContain(
      'No snapshot “deadbeefdead” in the history of nb.ipynb'
    );
  });

  it('says where the next snapshot goes, never "null"', async () => {
    const { api, panel, actions, notifier } = setup(fakeKernel('k1'));
    // After the restore of 1 (not a tip) the server plans a new thread.
    api.after = {
      ...history(),
      head: { thread: null, commit: ID(1), next_thread: 'main-1' }
    };
    answerDialogs(true);
    const result = await actions.restore(panel, ID(1).slice(0, 8));
    expect(result).not.toBeNull();
    expect(mocked.showDialog).toHaveBeenCalledTimes(1);
    expect(mocked.showDialog.mock.calls[0][0].title).toBe(
      'Restore snapshot 11111111 “[1] x = 1”?'
    );
    expect(api.restore.mock.calls[0][0]).toEqual({
      kernel_id: 'k1',
      commit: ID(1),
      branch: undefined,
      force: undefined
    });
    const done = notifier.notes[notifier.notes.length - 1];
    expect(done.type).toBe('success');
    expect(done.message).toBe(
      'Restored 11111111 in 460 ms · next snapshot starts new thread main-1'
    );
    expect(done.message).not.toContain('null');
  });

  it('falls back to the rules of plan_snapshot with an older server', async () => {
    const { api, panel, actions, notifier } = setup(fakeKernel('k1'));
    api.after = { ...history(), head: { thread: null, commit: ID(2) } };
    answerDialogs(true);
    await actions.restore(panel, ID(2));
    expect(notifier.notes[notifier.notes.length - 1].message).toBe(
      'Restored 22222222 in 460 ms · next snapshot starts new thread main-1'
    );
  });

  it('preselects HEAD in the picker, whose labels are whole', async () => {
    const { api, panel, actions } = setup(fakeKernel('k1'));
    answerDialogs(true, false); // pick, then cancel the confirmation
    await actions.restore(panel);
    const body = mocked.showDialog.mock.calls[0][0].body as CommitPicker;
    expect(body).toBeInstanceOf(CommitPicker);
    expect(body.getValue()).toBe(ID(3));
    const options = Array.from(
      body.node.querySelectorAll<HTMLElement>('[role="option"]')
    );
    const labels = options.map(o =>
      Array.from(o.children)
        .slice(0, -1)
        .map(c => c.textContent)
    );
    expect(labels).toEqual([
      ['HEAD', '33333333', 'third'],
      ['22222222', 'second'],
      ['11111111', '[1] x = 1']
    ]);
    expect(options.map(o => o.getAttribute('aria-selected'))).toEqual([
      'true',
      'false',
      'false'
    ]);
    expect(api.restore).not.toHaveBeenCalled();
  });

  it('without a kernel resumes into a new one instead', async () => {
    const { api, panel, actions } = setup(null);
    await actions.restore(panel, ID(2));
    expect(api.restore).not.toHaveBeenCalled();
    expect(api.resume).toHaveBeenCalledWith({
      path: 'nb.ipynb',
      commit: ID(2),
      new_notebook: undefined
    });
  });
});

describe('branch', () => {
  it('at HEAD starts a thread without touching the kernel (no warning)', async () => {
    const { api, panel, actions } = setup(fakeKernel('k1'));
    mocked.getText.mockResolvedValueOnce({
      button: { accept: true },
      value: 'exp'
    });
    await actions.branch(panel, ID(3));
    expect(mocked.showDialog).not.toHaveBeenCalled();
    expect(api.restore).not.toHaveBeenCalled();
    expect(api.branch).toHaveBeenCalledWith({ kernel_id: 'k1', name: 'exp' });
    expect(mocked.success.mock.calls[0][0]).toContain(
      'the kernel was not touched'
    );
  });

  it('elsewhere restores into the new thread after a confirmation', async () => {
    const { api, panel, actions, notifier } = setup(fakeKernel('k1'));
    mocked.getText.mockResolvedValueOnce({
      button: { accept: true },
      value: 'exp'
    });
    answerDialogs(true);
    await actions.branch(panel, ID(1));
    expect(mocked.showDialog.mock.calls[0][0].body).toContain('is lost');
    expect(api.restore.mock.calls[0][0]).toMatchObject({
      commit: ID(1),
      branch: 'exp'
    });
    expect(notifier.notes[notifier.notes.length - 1].message).toBe(
      'Restored 11111111 into new thread exp in 460 ms'
    );
  });

  it('refuses a thread name that exists', async () => {
    const { api, panel, actions } = setup(fakeKernel('k1'));
    mocked.getText
      .mockResolvedValueOnce({ button: { accept: true }, value: 'main' })
      .mockResolvedValueOnce({ button: { accept: false }, value: '' });
    await actions.branch(panel, ID(1));
    expect(mocked.warning.mock.calls[0][0]).toContain('already exists');
    expect(api.restore).not.toHaveBeenCalled();
  });
});

describe('resume', () => {
  it('starts a kernel for a notebook without one, no confirmation', async () => {
    const { api, panel, actions, notifier } = setup(null);
    api.after = {
      ...history(),
      head: { thread: 'main', commit: ID(2), next_thread: 'main-1' }
    };
    const result = await actions.resume(panel, ID(2).slice(0, 10));
    expect(result).toMatchObject({ kernel_id: 'k-resumed' });
    expect(mocked.showDialog).not.toHaveBeenCalled();
    // One session: the notebook's own, with a new Infinijup kernel, which the
    // server then resumes into.
    expect(panel.sessionContext.changeKernel.mock.calls).toEqual([
      [{ name: 'infinijup' }]
    ]);
    expect(api.resume).toHaveBeenCalledWith({
      path: 'nb.ipynb',
      commit: ID(2)
    });
    expect(notifier.notes[notifier.notes.length - 1].message).toBe(
      'Resumed 22222222 in a new kernel in 1.5 s · next snapshot starts new thread main-1'
    );
  });

  it('replaces a kernel Infinijup does not manage after a confirmation', async () => {
    const { api, panel, actions } = setup(fakeKernel('py-1', 'python3'));
    answerDialogs(false);
    await actions.resume(panel, ID(2));
    expect(mocked.showDialog.mock.calls[0][0].body).toContain(
      'Python 3 (ipykernel)'
    );
    expect(api.resume).not.toHaveBeenCalled();
    expect(panel.sessionContext.shutdown).not.toHaveBeenCalled();
    answerDialogs(true);
    await actions.resume(panel, ID(2));
    // The plain kernel is replaced in the notebook's session by an Infinijup
    // kernel, which the server then resumes into.
    expect(panel.sessionContext.shutdown).not.toHaveBeenCalled();
    expect(panel.sessionContext.changeKernel.mock.calls).toEqual([
      [{ name: 'infinijup' }]
    ]);
    expect(api.resume).toHaveBeenCalledTimes(1);
  });

  it('opens a new notebook next to this one', async () => {
    const { api, panel, actions, openNotebook, notifier } = setup(
      fakeKernel('k1')
    );
    await actions.resume(panel, ID(1), { newNotebook: true });
    expect(api.resume).toHaveBeenCalledWith({
      path: 'nb.ipynb',
      commit: ID(1),
      new_notebook: true,
      session: false
    });
    expect(api.restore).not.toHaveBeenCalled();
    expect(openNotebook).toHaveBeenCalledWith('nb-11111111.ipynb', 'k-new-nb');
    expect(panel.sessionContext.changeKernel).not.toHaveBeenCalled();
    expect(notifier.notes[notifier.notes.length - 1].message).toBe(
      'Opened 11111111 in nb-11111111.ipynb: a new kernel resumed in 1.5 s'
    );
  });

  it('moves a session still at the old name to the file first (a notebook just renamed)', async () => {
    const { api, panel, actions } = setup(fakeKernel('k1'));
    // Lab renamed the file; the session follows a moment later.
    panel.context.localPath = 'nb.ipynb';
    const session = panel.sessionContext.session;
    session.path = 'Untitled.ipynb';
    session.setPath = jest.fn(async (to: string) => {
      session.path = to;
    });
    await actions.resume(panel, ID(1), { newNotebook: true });
    expect(session.setPath).toHaveBeenCalledWith('nb.ipynb');
    expect(api.resume).toHaveBeenCalledWith({
      path: 'nb.ipynb',
      commit: ID(1),
      new_notebook: true,
      session: false
    });
  });

  it('of a managed notebook restores in place', async () => {
    const { api, panel, actions } = setup(fakeKernel('k1'));
    answerDialogs(true);
    await actions.resume(panel, ID(2));
    expect(api.resume).not.toHaveBeenCalled();
    expect(api.restore).toHaveBeenCalledTimes(1);
  });

  it('refuses a commit the server marks not resumable, with its reason', async () => {
    const { api, panel, actions } = setup(null);
    api.current.commits[1].resumable = false;
    api.current.commits[1].resumable_reason = 'taken on 1x H100, here 1x H200';
    await actions.resume(panel, ID(2));
    expect(api.resume).not.toHaveBeenCalled();
    expect(mocked.error.mock.calls[0][0]).toContain(
      'cannot be resumed here: taken on 1x H100, here 1x H200'
    );
  });

  it('reports a failure of the server', async () => {
    const { api, panel, actions, notifier } = setup(null);
    api.resume.mockRejectedValueOnce(new Error('helper down'));
    expect(await actions.resume(panel, ID(2))).toBeNull();
    await flush();
    const last = notifier.notes[notifier.notes.length - 1];
    expect(last.type).toBe('error');
    expect(last.message).toContain('Resume of nb.ipynb failed: helper down');
  });
});

describe('CommitPicker', () => {
  it('selects by click and keys, and lets a typed ref win', () => {
    const h = history();
    const picker = new CommitPicker({ commits: h.commits, head: ID(2) });
    expect(picker.getValue()).toBe(ID(2));
    const list = picker.node.querySelector<HTMLElement>('[role="listbox"]')!;
    list.dispatchEvent(new KeyboardEvent('keydown', { key: 'ArrowDown' }));
    expect(picker.getValue()).toBe(ID(1));
    list.dispatchEvent(new KeyboardEvent('keydown', { key: 'Home' }));
    expect(picker.getValue()).toBe(ID(3));
    picker.node
      .querySelector<HTMLElement>(`[data-id="${ID(2)}"] .jp-Infinijup-id`)!
      .click();
    expect(picker.getValue()).toBe(ID(2));
    const input = picker.node.querySelector('input')!;
    input.value = ' main ';
    expect(picker.getValue()).toBe('main');
    expect(new CommitPicker({ commits: [] }).getValue()).toBe('');
    // Without HEAD in the list, the newest is preselected.
    expect(new CommitPicker({ commits: h.commits }).getValue()).toBe(ID(3));
  });
});
