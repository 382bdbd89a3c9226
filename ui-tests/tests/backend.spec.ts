/**
 * End-to-end tests against a real JupyterLab with the Infinijup server
 * extension and a real Infinijup kernel (kernelspec "infinijup", CRIU).
 *
 * Needs: `pip install -e .` of this repo (server extension, provisioner,
 * kernelspec, labextension), CRIU and the helper daemon (scripts/setup-criu.sh),
 * Debian's chromium. Every test first checks GET /infinijup/status for its
 * kernel: without the backend they fail there, they never pass vacuously.
 */

import {
  expect,
  galata,
  IJupyterLabPageFixture,
  test
} from '@jupyterlab/galata';

import {
  createNotebook,
  dismissToasts,
  execute,
  notified,
  openHistory,
  widenRightPanel,
  screenshot,
  toasts,
  waitForKernelIdle
} from './helpers';

/** Distinguishes this run's notebooks from those of earlier runs. */
const RUN = Date.now().toString(36);

/** CRIU dumps and restores take seconds, more on a busy machine. */
const OP_TIMEOUT = 90_000;

test.use({
  mockSettings: {
    ...galata.DEFAULT_SETTINGS,
    // Ask nothing on snapshot; keep the restore confirmation (tested).
    'infinijup:plugin': { askMessage: false, confirmRestore: true }
  }
});

/**
 * Create a notebook on the Infinijup kernel; check the backend manages it.
 *
 * History belongs to the kernel's session path and outlives the server, so
 * each run uses fresh names (`<stem>-<run>.ipynb`). The file is written with
 * its kernelspec and then opened (galata's createNew renames an Untitled
 * notebook through the contents API, which leaves the server's session at
 * Untitled.ipynb, a path earlier runs used too).
 */
async function infinijupNotebook(
  page: IJupyterLabPageFixture,
  tmpPath: string,
  stem: string
): Promise<{ kernelId: string; name: string }> {
  const specs = await (await page.request.get('/api/kernelspecs')).json();
  expect(
    Object.keys(specs.kernelspecs),
    'the "infinijup" kernelspec must be installed (pip install -e . installs it)'
  ).toContain('infinijup');
  const name = `${stem}-${RUN}.ipynb`;
  const path = `${tmpPath}/${name}`;
  const put = await page.request.put(`/api/contents/${path}`, {
    data: {
      type: 'notebook',
      format: 'json',
      content: {
        nbformat: 4,
        nbformat_minor: 5,
        metadata: {
          kernelspec: {
            name: 'infinijup',
            display_name: 'Python 3 (Infinijup)',
            language: 'python'
          }
        },
        cells: [
          {
            cell_type: 'code',
            source: '',
            metadata: {},
            outputs: [],
            execution_count: null,
            id: 'c0'
          }
        ]
      }
    }
  });
  expect(put.status()).toBeLessThan(300);
  await page.filebrowser.refresh();
  expect(await page.notebook.openByPath(path)).toBe(true);
  await page.notebook.activate(name);
  const kernelId = await page.evaluate(async () => {
    const widget = (window as any).jupyterapp.shell.currentWidget;
    await widget.sessionContext.ready;
    for (let i = 0; i < 120 && !widget.sessionContext.session?.kernel; i++) {
      await new Promise(resolve => setTimeout(resolve, 500));
    }
    return (widget.sessionContext.session?.kernel?.id as string) ?? null;
  });
  expect(
    kernelId,
    'the Infinijup kernel did not start (see the server log)'
  ).not.toBeNull();
  await waitForKernelIdle(page);
  const response = await page.request.get(
    `/infinijup/status?kernel_id=${kernelId}`
  );
  expect(
    response.status(),
    'GET /infinijup/status must answer 200: is the infinijup server extension installed (pip install -e .) and enabled?'
  ).toBe(200);
  const status = await response.json();
  expect(
    status.managed,
    'the "infinijup" kernel must run under the Infinijup provisioner'
  ).toBe(true);
  return { kernelId: kernelId!, name };
}

/** Run code in a new cell at the end and return its text output. */
async function run(
  page: IJupyterLabPageFixture,
  code: string
): Promise<string> {
  const count = await page.notebook.getCellCount();
  const last = count - 1;
  const lastText = await page.notebook.getCellTextInput(last);
  let index = last;
  if (lastText.trim() === '') {
    await page.notebook.setCell(last, 'code', code);
  } else {
    await page.notebook.addCell('code', code);
    index = count;
  }
  await page.notebook.runCell(index, true);
  return ((await page.notebook.getCellTextOutput(index)) ?? []).join('').trim();
}

/** Click the toolbar's Snapshot button; return the new commit's short id. */
async function snapshot(
  page: IJupyterLabPageFixture,
  thread = 'main'
): Promise<string> {
  const response = page.waitForResponse(
    r =>
      /\/infinijup\/snapshot/.test(r.url()) && r.request().method() === 'POST',
    { timeout: OP_TIMEOUT }
  );
  await page
    .locator(
      '.jp-NotebookPanel:not(.lm-mod-hidden) [data-jp-item-name="infinijup-snapshot"]'
    )
    .click();
  const reply = await response;
  const body = await reply.json();
  expect(reply.status(), JSON.stringify(body)).toBe(201);
  expect(body.thread).toBe(thread);
  const short = (body.commit as string).slice(0, 8);
  await notified(page, `Snapshot ${short} saved on ${thread}`);
  // Said: its toast would otherwise cover the history panel's lower rows.
  await dismissToasts(page);
  return short;
}

/** The current notebook's path (server-relative). */
async function notebookPath(page: IJupyterLabPageFixture): Promise<string> {
  return page.evaluate(
    () => (window as any).jupyterapp.shell.currentWidget.context.path as string
  );
}

function row(page: IJupyterLabPageFixture, shortId: string) {
  return page.locator(
    `#infinijup-history .jp-Infinijup-row[data-commit-id^="${shortId}"]`
  );
}

test.describe('Infinijup end to end @backend', () => {
  test('snapshot, change a variable, restore from the panel: the old value is back', async ({
    page,
    tmpPath
  }, testInfo) => {
    const { kernelId } = await infinijupNotebook(page, tmpPath, 'restore');
    await expect
      .poll(() =>
        page
          .locator(
            '.jp-NotebookPanel:not(.lm-mod-hidden) [data-jp-item-name="infinijup-snapshot"]'
          )
          .isVisible()
      )
      .toBe(true);
    expect(await run(page, 'x = 41\nx')).toBe('41');

    const head = page.locator(
      '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Infinijup-head'
    );
    await expect(head).toHaveText('no snapshot');
    const first = await snapshot(page);
    // The notebook's toolbar says which snapshot its kernel is in.
    await expect(head).toHaveText(`at ${first}`);
    await openHistory(page);
    await expect(row(page, first)).toHaveClass(/jp-mod-head/);
    await expect(
      row(page, first).locator('.jp-Infinijup-chip-thread')
    ).toHaveText('main');
    // The kernel described the commit: its last cell and the variable it set.
    await expect(
      row(page, first).locator('.jp-Infinijup-row-message')
    ).toHaveText('[1] x = 41');
    await row(page, first).click();
    await expect(
      page.locator(
        '#infinijup-history .jp-Infinijup-vars > .jp-Infinijup-vartable tr'
      )
    ).toHaveText([/^x\s*int\s*\d+ B$/]);

    expect(await run(page, 'x = 99\nx')).toBe('99');

    await row(page, first).click();
    await page
      .locator('.jp-Infinijup-details')
      .getByRole('button', { name: 'Restore' })
      .click();
    await page
      .locator('.jp-Dialog')
      .getByRole('button', { name: 'Restore' })
      .click();
    await expect(
      toasts(page).filter({ hasText: `Restored ${first}` })
    ).toContainText('next snapshot on main', {
      timeout: OP_TIMEOUT
    });

    // Same kernel id, no reload, the kernel answers and is idle.
    const after = await page.evaluate(() => {
      const widget = (window as any).jupyterapp.shell.currentWidget;
      const kernel = widget.sessionContext.session.kernel;
      return {
        id: kernel.id,
        status: kernel.status,
        connection: kernel.connectionStatus
      };
    });
    expect(after).toEqual({
      id: kernelId,
      status: 'idle',
      connection: 'connected'
    });
    await expect(
      page
        .locator('.jp-Notebook-ExecutionIndicator, [data-status="idle"]')
        .first()
    ).toBeAttached();

    expect(await run(page, 'print(x)')).toBe('41');
    // Execution counts went back to the snapshot's; the toolbar says where the kernel is.
    await expect(head).toHaveText(`at ${first}`);
    await screenshot(
      page.locator(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-NotebookPanel-toolbar'
      ),
      testInfo,
      'toolbar-head'
    );

    const shot = testInfo.outputPath('history-panel-after-restore.png');
    await page.locator('#infinijup-history').screenshot({ path: shot });
    await testInfo.attach('history-panel-after-restore', {
      path: shot,
      contentType: 'image/png'
    });
  });

  test('branch: a new thread starts at an old snapshot and gets the next one', async ({
    page,
    tmpPath
  }, testInfo) => {
    test.setTimeout(4 * OP_TIMEOUT); // three snapshots and a restore: as the other long stories
    await infinijupNotebook(page, tmpPath, 'branch');
    expect(await run(page, 'x = 1\nx')).toBe('1');
    const a = await snapshot(page);
    expect(await run(page, 'x = 2\nx')).toBe('2');
    const b = await snapshot(page);
    await openHistory(page);
    await expect(
      page.locator('#infinijup-history .jp-Infinijup-row')
    ).toHaveCount(2);
    await expect(row(page, b)).toHaveClass(/jp-mod-head/);

    // Branch from the first snapshot, from its row.
    await row(page, a).click();
    await page
      .locator('.jp-Infinijup-details')
      .getByRole('button', { name: 'Branch from here' })
      .click();
    await page.locator('.jp-Dialog input').fill('exp');
    await page
      .locator('.jp-Dialog')
      .getByRole('button', { name: 'Next' })
      .click();
    await page
      .locator('.jp-Dialog')
      .getByRole('button', { name: 'Branch' })
      .click();
    await expect(
      toasts(page).filter({ hasText: 'into new thread exp' })
    ).toBeVisible({
      timeout: OP_TIMEOUT
    });
    await expect(row(page, a)).toHaveClass(/jp-mod-head/);
    await expect(
      page.locator('#infinijup-history .jp-Infinijup-summary')
    ).toContainText('next snapshot on exp');
    expect(await run(page, 'print(x)')).toBe('1');

    expect(await run(page, 'x = 3\nx')).toBe('3');
    const c = await snapshot(page, 'exp');
    await expect(
      page.locator('#infinijup-history .jp-Infinijup-row')
    ).toHaveCount(3);
    await expect(row(page, c)).toHaveClass(/jp-mod-head/);
    await expect(row(page, c).locator('.jp-Infinijup-chip-thread')).toHaveText(
      'exp'
    );
    // Two lanes: main (a, b) and exp (c), joined at a.
    const lanes = await page.evaluate(() =>
      Array.from(
        document.querySelectorAll(
          '#infinijup-history .jp-Infinijup-row circle, #infinijup-history .jp-Infinijup-row rect'
        )
      ).map(n =>
        Number(n.getAttribute('cx') ?? Number(n.getAttribute('x')) + 4.5)
      )
    );
    expect(new Set(lanes).size).toBe(2);

    const history = await (
      await page.request.get(
        `/infinijup/history?path=${encodeURIComponent(await notebookPath(page))}`
      )
    ).json();
    const commitC = history.commits.find((x: any) => x.id.startsWith(c));
    expect(commitC.thread).toBe('exp');
    expect(commitC.parents[0].startsWith(a)).toBe(true);

    const shot = testInfo.outputPath('history-panel-branch.png');
    await page.locator('#infinijup-history').screenshot({ path: shot });
    await testInfo.attach('history-panel-branch', {
      path: shot,
      contentType: 'image/png'
    });
  });

  test('an unknown commit is refused before any confirmation; the kernel is untouched', async ({
    page,
    tmpPath
  }) => {
    const { name } = await infinijupNotebook(page, tmpPath, 'unknown');
    expect(await run(page, 'y = 7\ny')).toBe('7');
    const restores: string[] = [];
    page.on('request', r => {
      if (/\/infinijup\/restore/.test(r.url())) {
        restores.push(r.url());
      }
    });
    await execute(page, 'infinijup:restore', { commit: 'deadbeefdeadbeef' });
    await expect(
      toasts(page).filter({
        hasText: `No snapshot “deadbeefdeadbeef” in the history of ${name}`
      })
    ).toBeVisible();
    await expect(page.locator('.jp-Dialog')).toHaveCount(0);
    expect(restores).toEqual([]);
    expect(await run(page, 'print(y)')).toBe('7');
  });

  test('after restoring an older commit the panel says the next snapshot starts main-1, and it does', async ({
    page,
    tmpPath
  }, testInfo) => {
    const { kernelId } = await infinijupNotebook(page, tmpPath, 'next');
    expect(await run(page, 'x = 1\nx')).toBe('1');
    const a = await snapshot(page);
    expect(await run(page, 'x = 2\nx')).toBe('2');
    await snapshot(page);
    await openHistory(page);
    const headline = page.locator('#infinijup-history .jp-Infinijup-headline');
    await expect(headline).toContainText('next snapshot on main');

    await row(page, a).click();
    await page
      .locator('#infinijup-history .jp-Infinijup-details')
      .getByRole('button', { name: 'Restore' })
      .click();
    await page
      .locator('.jp-Dialog')
      .getByRole('button', { name: 'Restore' })
      .click();
    const toast = toasts(page).filter({ hasText: `Restored ${a}` });
    await expect(toast).toContainText(
      'next snapshot starts new thread main-1',
      { timeout: OP_TIMEOUT }
    );
    await expect(toast).not.toContainText('null');
    await expect(headline).toHaveText(
      `HEAD ${a} (not a thread tip) · next snapshot starts new thread main-1`
    );
    const history = await (
      await page.request.get(`/infinijup/history?kernel_id=${kernelId}`)
    ).json();
    expect(history.head.next_thread).toBe('main-1');
    await screenshot(
      page.locator('#infinijup-history'),
      testInfo,
      'backend-next-thread',
      { docs: false }
    );
    // The next snapshot goes where the panel said.
    expect(await run(page, 'x = 3\nx')).toBe('3');
    await snapshot(page, 'main-1');
    await expect(headline).toContainText('next snapshot on main-1');
  });

  test('a plain python3 kernel: the shortcut says why it cannot be snapshotted', async ({
    page
  }) => {
    await createNotebook(page, `plain-${RUN}.ipynb`);
    await waitForKernelIdle(page);
    const kernelId = await page.evaluate(
      () =>
        (window as any).jupyterapp.shell.currentWidget.sessionContext.session
          .kernel.id as string
    );
    const status = await (
      await page.request.get(`/infinijup/status?kernel_id=${kernelId}`)
    ).json();
    expect(status.managed).toBe(false);
    const snapshots: string[] = [];
    page.on('request', r => {
      if (/\/infinijup\/snapshot/.test(r.url())) {
        snapshots.push(r.url());
      }
    });
    await page.notebook.selectCells(0);
    await page.keyboard.press('Escape');
    await page.keyboard.press('Control+Alt+s');
    await expect(
      toasts(page).filter({ hasText: 'is not managed by Infinijup' })
    ).toContainText('Python 3 (Infinijup)');
    expect(snapshots).toEqual([]);
  });

  test('snapshots from %snapshot and the shortcut appear in the panel live', async ({
    page,
    tmpPath
  }) => {
    await infinijupNotebook(page, tmpPath, 'live');
    await openHistory(page);
    const rows = page.locator('#infinijup-history .jp-Infinijup-row');
    await expect(
      page.locator('#infinijup-history .jp-Infinijup-empty')
    ).toBeVisible();

    // The magic: the server's events update the panel, no refresh.
    await run(page, 'z = 5\n%snapshot');
    await expect(rows).toHaveCount(1, { timeout: OP_TIMEOUT });

    // The keyboard shortcut (Accel Alt S) in command mode.
    await page.notebook.selectCells(0);
    await page.keyboard.press('Escape');
    await page.keyboard.press('Control+Alt+s');
    await expect(rows).toHaveCount(2, { timeout: OP_TIMEOUT });
  });

  // Issue 11: needs POST /infinijup/resume on the server.
  test('resume: a notebook whose kernel was shut down resumes a snapshot, here and in a new notebook', async ({
    page,
    tmpPath
  }, testInfo) => {
    test.setTimeout(4 * OP_TIMEOUT); // two resumes, each up to OP_TIMEOUT on a busy machine
    const { name } = await infinijupNotebook(page, tmpPath, 'resume');
    expect(await run(page, 'x = 41\nx')).toBe('41');
    const a = await snapshot(page);
    expect(await run(page, 'x = 99\nx')).toBe('99');
    await page.evaluate(() =>
      (window as any).jupyterapp.shell.currentWidget.sessionContext.shutdown()
    );
    await openHistory(page);
    const panel = page.locator('#infinijup-history');
    await expect(panel.locator('.jp-Infinijup-status')).toContainText(
      'No kernel is running'
    );
    await expect(panel.locator('.jp-Infinijup-row')).toHaveCount(1);
    await row(page, a).click();
    await screenshot(panel, testInfo, 'backend-no-kernel', { docs: false });
    await panel
      .locator('.jp-Infinijup-details')
      .getByRole('button', { name: 'Resume here' })
      .click();
    await notified(page, `Resumed ${a} in a new kernel`, OP_TIMEOUT);
    await waitForKernelIdle(page);
    expect(await run(page, 'print(x)')).toBe('41');
    // One session for the notebook (issue 28, item 5): the one Lab made.
    const sessionsAt = async (path: string): Promise<string[]> => {
      const all = await (await page.request.get('/api/sessions')).json();
      return all
        .filter((s: any) => s.path === path)
        .map((s: any) => `${s.id} ${s.name} ${s.kernel?.id}`);
    };
    expect(await sessionsAt(`${tmpPath}/${name}`)).toHaveLength(1);

    // The same snapshot in a new notebook next to this one.
    await row(page, a).click();
    await panel
      .locator('.jp-Infinijup-details')
      .getByRole('button', { name: 'Open in new notebook' })
      .click();
    const copy = name.replace(/\.ipynb$/, `-${a}.ipynb`);
    await notified(page, `Opened ${a} in ${copy}`, OP_TIMEOUT);
    await expect
      .poll(() =>
        page.evaluate(
          () =>
            (window as any).jupyterapp.shell.currentWidget?.context?.path ?? ''
        )
      )
      .toContain(copy);
    await waitForKernelIdle(page);
    expect(await run(page, 'print(x)')).toBe('41');
    expect(await sessionsAt(`${tmpPath}/${copy}`)).toHaveLength(1);
    expect(await sessionsAt(`${tmpPath}/${name}`)).toHaveLength(1);
  });
});

/**
 * Kernel › Restart, with Galata's tracking of the kernels API off: it proxies every POST under
 * /api/kernels and answers 201, and Lab takes anything but 200 from a restart for a failure
 * (it then never reconnects and the status bar says "Starting" for good). The notebook's
 * session is still tracked, and its kernel shut down with it.
 */
test.describe('Restart lineage @backend', () => {
  test.use({ kernels: null });

  test('after Kernel › Restart the next snapshot is a new root, and the panel says so', async ({
    page,
    tmpPath
  }, testInfo) => {
    test.setTimeout(4 * OP_TIMEOUT);
    await infinijupNotebook(page, tmpPath, 'restart');
    expect(await run(page, 'x = 1\nx')).toBe('1');
    const a = await snapshot(page);
    await openHistory(page);
    const headline = page.locator('#infinijup-history .jp-Infinijup-headline');
    await expect(headline).toHaveText(`HEAD ${a} · next snapshot on main`);
    await page.evaluate(() =>
      (
        window as any
      ).jupyterapp.shell.currentWidget.sessionContext.restartKernel()
    );
    await waitForKernelIdle(page);
    await expect(
      page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Infinijup-head')
    ).toHaveText('no snapshot', { timeout: OP_TIMEOUT });
    // The header follows the restart: no old HEAD, a new root next.
    await expect(headline).toHaveText(
      'Fresh kernel · next snapshot starts new root main-1',
      { timeout: OP_TIMEOUT }
    );
    await screenshot(
      page.locator('#infinijup-history'),
      testInfo,
      'restart-new-root'
    );
    expect(await run(page, "'x' in dir()")).toBe('False');
    const b = await snapshot(page, 'main-1');
    await row(page, b).click();
    const card = page.locator('#infinijup-history .jp-Infinijup-details');
    await expect(card.locator('tr', { hasText: 'Parents' })).toContainText(
      'none (first snapshot)'
    );
    // Nothing was "deleted": the new root descends from nothing.
    await expect(card.locator('.jp-Infinijup-removed')).toHaveCount(0);
  });
});

/** Issue 28's stories against the real backend. */
test.describe('History that says what happened @backend', () => {
  test('Compare shows the values that differ', async ({
    page,
    tmpPath
  }, testInfo) => {
    test.setTimeout(4 * OP_TIMEOUT);
    await infinijupNotebook(page, tmpPath, 'compare');
    expect(await run(page, "counter = 111\nname = 'before'\ncounter")).toBe(
      '111'
    );
    const a = await snapshot(page);
    expect(await run(page, "counter = 11\nname = 'after'\ncounter")).toBe('11');
    const b = await snapshot(page);
    await openHistory(page);
    await row(page, b).click();
    const card = page.locator('#infinijup-history .jp-Infinijup-details');
    await card.getByRole('button', { name: 'Compare…' }).click();
    await row(page, a).click();
    const diffs = card.locator('.jp-Infinijup-diffs li');
    await expect(diffs.filter({ hasText: 'counter' })).toHaveText(
      /counter differs: 11 \(int.*\) → 111 \(int.*\)/
    );
    await expect(diffs.filter({ hasText: 'name' })).toHaveText(
      /name differs: 'after' \(str.*\) → 'before' \(str.*\)/
    );
    await screenshot(
      page.locator('#infinijup-history'),
      testInfo,
      'compare-values'
    );
  });

  test('Delete thread removes it and what only it had; the header shows the sizes', async ({
    page,
    tmpPath
  }, testInfo) => {
    test.setTimeout(4 * OP_TIMEOUT);
    await infinijupNotebook(page, tmpPath, 'delete');
    expect(await run(page, 'x = 1\nx')).toBe('1');
    const a = await snapshot(page);
    await run(page, '%branch idea');
    expect(await run(page, 'x = 2\nx')).toBe('2');
    const b = await snapshot(page, 'idea');
    await openHistory(page);
    const rows = page.locator('#infinijup-history .jp-Infinijup-row');
    await expect(rows).toHaveCount(2);
    await row(page, b).click();
    const card = page.locator('#infinijup-history .jp-Infinijup-details');
    // The kernel stands on b (its HEAD cannot go): back to a first.
    await restoreFromPanel(page, a);
    await row(page, b).click();
    await card.getByRole('button', { name: 'Delete thread idea' }).click();
    const dialog = page.locator('.jp-Dialog');
    await expect(dialog).toContainText(
      'Delete thread idea? 1 snapshot only this thread has goes with it'
    );
    await screenshot(page, testInfo, 'delete-thread', { docs: true });
    await dialog.getByRole('button', { name: 'Delete' }).click();
    await expect(
      toasts(page).filter({ hasText: 'Delete of thread idea:' })
    ).toBeVisible({
      timeout: OP_TIMEOUT
    });
    await expect(rows).toHaveCount(1);
    await expect(row(page, a)).toHaveCount(1);
    await expect(
      page.locator('#infinijup-history .jp-Infinijup-space')
    ).toContainText('Store');
  });

  test('a hibernated kernel stays asleep while the user switches tabs', async ({
    page,
    tmpPath
  }) => {
    test.setTimeout(4 * OP_TIMEOUT);
    const first = await infinijupNotebook(page, tmpPath, 'sleepy');
    expect(await run(page, 'x = 1\nx')).toBe('1');
    const second = await infinijupNotebook(page, tmpPath, 'awake');
    await page.notebook.activate(first.name);
    const reply = page.waitForResponse(
      r =>
        /\/infinijup\/hibernate(\?|$)/.test(r.url()) &&
        r.request().method() === 'POST',
      { timeout: OP_TIMEOUT }
    );
    await execute(page, 'infinijup:hibernate');
    expect((await reply).status()).toBe(200);
    const state = async () =>
      (
        await (
          await page.request.get(
            `/infinijup/status?kernel_id=${first.kernelId}`
          )
        ).json()
      ).lifecycle;
    expect(await state()).toBe('hibernated');
    for (let i = 0; i < 3; i++) {
      await page.notebook.activate(second.name);
      await waitForKernelIdle(page);
      await page.notebook.activate(first.name);
      await expect(
        page.locator(
          '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Infinijup-rest-toolbar'
        )
      ).toHaveText('Hibernated');
    }
    // Nothing woke it: no restore ran (the last operation is still the hibernation).
    const status = await (
      await page.request.get(`/infinijup/status?kernel_id=${first.kernelId}`)
    ).json();
    expect(status.lifecycle).toBe('hibernated');
    expect(status.last_operation?.op).not.toBe('restore');
    // A cell does wake it.
    expect(await run(page, 'x + 1')).toBe('2');
  });
});

/** Restore a commit from its row's card (confirming). */
async function restoreFromPanel(page: IJupyterLabPageFixture, shortId: string) {
  await row(page, shortId).click();
  await page
    .locator('.jp-Infinijup-details')
    .getByRole('button', { name: 'Restore' })
    .click();
  await page
    .locator('.jp-Dialog')
    .getByRole('button', { name: 'Restore' })
    .click();
  await notified(page, `Restored ${shortId}`, OP_TIMEOUT);
  await dismissToasts(page);
}

/** Issue 30: Undo and Redo of cells against the real backend. */
test.describe('Undo @backend', () => {
  test('the Undo button goes back before the last cell; Redo returns', async ({
    page,
    tmpPath
  }, testInfo) => {
    test.setTimeout(4 * OP_TIMEOUT);
    await infinijupNotebook(page, tmpPath, 'undo');
    expect(await run(page, 'x = 1\nx')).toBe('1');
    await snapshot(page);
    expect(await run(page, 'x = 2\nx')).toBe('2');
    const undo = page.locator(
      '.jp-NotebookPanel:not(.lm-mod-hidden) [data-jp-item-name="infinijup-undo"]'
    );
    await expect(undo).toBeVisible();
    await undo.click();
    // The kernel changed since its snapshot: that state is saved, then the
    // kernel goes back to the snapshot, and the notification says where.
    const done = toasts(page).filter({ hasText: 'Redo brings it back' });
    await expect(done).toContainText('Back to after [1] x = 1', {
      timeout: OP_TIMEOUT
    });
    await screenshot(page, testInfo, 'undo-toast', {
      clip: { x: 700, y: 0, width: 700, height: 900 }
    });
    expect(await run(page, 'print(x)')).toBe('1');
    await page.evaluate(() =>
      (window as any).jupyterapp.commands.execute('infinijup:redo')
    );
    await expect(
      toasts(page).filter({ hasText: 'Redone: back to after' })
    ).toBeVisible({ timeout: OP_TIMEOUT });
    expect(await run(page, 'print(x)')).toBe('2');
  });
});

/** Issue 30: the per-cell timeline ("Cells") against the real backend. */
test.describe('Cells timeline @backend', () => {
  test('one row per cell that made a snapshot; gaps say which made none; Undo marks the cell undone', async ({
    page,
    tmpPath
  }, testInfo) => {
    test.setTimeout(4 * OP_TIMEOUT);
    await infinijupNotebook(page, tmpPath, 'cells');
    await openHistory(page);
    await widenRightPanel(page);
    await page
      .locator('#infinijup-history .jp-Infinijup-cells-toggle input')
      .check();
    const cells = page.locator(
      '#infinijup-history .jp-Infinijup-timeline [data-commit-id]'
    );
    await expect(
      page.locator('#infinijup-history .jp-Infinijup-timeline-empty')
    ).toHaveText('No snapshot on this path yet.');

    expect(await run(page, 'a = 1\na')).toBe('1'); // [1]
    await snapshot(page); // manual
    await expect(cells).toHaveCount(1, { timeout: OP_TIMEOUT });
    // Every cell that changes a variable earns one from here on.
    await run(page, '%autosnapshot on after=0.0001'); // [2]: its own magic, none
    await run(page, 'b = a + 1'); // [3]
    await expect(cells).toHaveCount(2, { timeout: OP_TIMEOUT });
    await run(page, "print('only prints')"); // [4]: changed nothing, none
    await run(page, 'c = b * 10'); // [5]
    await expect(cells).toHaveCount(3, { timeout: OP_TIMEOUT });

    const count = cells.locator('.jp-Infinijup-cell-count');
    await expect(count).toHaveText(['[5]', '[3]', '[1]']);
    await expect(cells.nth(0)).toHaveClass(/jp-mod-auto/);
    await expect(cells.nth(0)).toHaveClass(/jp-mod-head/);
    await expect(cells.nth(0)).toContainText('c = b * 10');
    await expect(cells.nth(0).locator('.jp-Infinijup-cell-vars')).toHaveText(
      'c'
    );
    await expect(cells.nth(2)).toHaveClass(/jp-mod-manual/);
    await expect(
      page.locator('#infinijup-history .jp-Infinijup-cell-gap')
    ).toHaveText([
      'cell [4] made no snapshot (too quick, or changed nothing)',
      'cell [2] made no snapshot (too quick, or changed nothing)'
    ]);
    await screenshot(page, testInfo, 'cells-timeline', {
      clip: { x: 900, y: 0, width: 500, height: 600 }
    });

    // The search keeps the matching cells (text or variable).
    const search = page.locator(
      '#infinijup-history .jp-Infinijup-search input'
    );
    await search.fill('a + 1');
    await expect(count).toHaveText(['[3]']);
    await search.fill('');
    await expect(cells).toHaveCount(3);

    // Undo: the kernel stands on [5]'s snapshot, unchanged: back to [3]'s.
    await page
      .locator(
        '.jp-NotebookPanel:not(.lm-mod-hidden) [data-jp-item-name="infinijup-undo"]'
      )
      .click();
    await expect(
      toasts(page).filter({ hasText: 'Redo brings it back' })
    ).toContainText('[3] b = a + 1', { timeout: OP_TIMEOUT });
    await expect(cells.nth(0)).toHaveClass(/jp-mod-ahead/);
    await expect(cells.nth(0)).toContainText('undone');
    await expect(cells.nth(1)).toHaveClass(/jp-mod-head/);
    expect(await run(page, "print(b, 'c' in dir())")).toBe('2 False');

    // A row selects its snapshot; the card restores it.
    await dismissToasts(page);
    await cells.nth(2).click();
    await expect(
      page
        .locator('#infinijup-history .jp-Infinijup-details')
        .getByRole('button', { name: 'Restore' })
    ).toBeVisible();
  });
});

/** Issue 30: Lab's setting, the Undo shortcut and the Kernel menu's Redo, in a browser. */
test.describe('Undo from the keyboard and the menu @backend', () => {
  test.use({
    mockSettings: {
      ...galata.DEFAULT_SETTINGS,
      'infinijup:plugin': { autosnapshot: 'on' }
    }
  });

  test("Lab's setting turns the kernel's automatic snapshots on; Accel Alt Z undoes; Kernel › Redo Cell redoes", async ({
    page,
    tmpPath
  }) => {
    test.setTimeout(4 * OP_TIMEOUT);
    // The setting is sent to each Infinijup kernel once Lab knows it is managed.
    const told = page.waitForResponse(
      r =>
        /\/infinijup\/autosnapshot/.test(r.url()) &&
        r.request().method() === 'POST',
      { timeout: OP_TIMEOUT }
    );
    await infinijupNotebook(page, tmpPath, 'undo-keys');
    const reply = await told;
    expect(reply.status()).toBe(200);
    expect((await reply.json()).on).toBe(true);
    expect(await run(page, '%autosnapshot status')).toContain(
      'Automatic snapshots are on'
    );

    expect(await run(page, 'x = 1\nx')).toBe('1'); // [2]
    await snapshot(page);
    expect(await run(page, 'x = 2\nx')).toBe('2'); // [3]: too quick to snapshot
    // Command mode, then the shortcut.
    await page.notebook.selectCells(0);
    await page.keyboard.press('Escape');
    await page.keyboard.press('Control+Alt+z');
    await expect(
      toasts(page).filter({ hasText: 'Redo brings it back' })
    ).toContainText('[2] x = 1', { timeout: OP_TIMEOUT });
    expect(await run(page, 'print(x)')).toBe('1');

    await page.menu.clickMenuItem('Kernel>Redo Cell');
    await expect(
      toasts(page).filter({ hasText: 'Redone: back to after' })
    ).toBeVisible({ timeout: OP_TIMEOUT });
    expect(await run(page, 'print(x)')).toBe('2');
  });
});
