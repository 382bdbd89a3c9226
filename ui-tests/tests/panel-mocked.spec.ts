/**
 * UI tests that need JupyterLab only: the Infinijup REST API and the event
 * socket are mocked (tests/helpers.ts MockBackend). They check the frontend's
 * own behavior: commands and menus, the toolbar button, the history panel on a
 * large history, progress notifications fed by events, error notifications,
 * live updates.
 *
 * The end-to-end tests against the real server extension and a real Infinijup
 * kernel are in backend.spec.ts.
 */

import { expect, galata, test } from '@jupyterlab/galata';

import { syntheticHistory } from '../../labextension/test/synthetic';
import {
  commit,
  createNotebook,
  currentKernelId,
  demoHistory,
  execute,
  hex,
  MockBackend,
  openHistory,
  screenshot,
  toasts,
  widenRightPanel
} from './helpers';

test.use({ autoGoto: false });

test.describe('Infinijup panel @mocked', () => {
  let backend: MockBackend;

  test.beforeEach(async ({ page }) => {
    backend = new MockBackend();
    await backend.install(page);
    await page.goto();
  });

  test('adds commands to the palette and the Kernel menu', async ({ page }) => {
    await createNotebook(page, 'menu.ipynb');
    await page.menu.open('Kernel');
    const menu = page.locator('.lm-Menu').last();
    for (const label of [
      'Snapshot Kernel',
      'Restore Kernel Snapshot…',
      'Branch from Kernel Snapshot…',
      'Show Kernel History'
    ]) {
      await expect(menu.getByText(label, { exact: true })).toBeVisible();
    }
    await page.keyboard.press('Escape');

    await page.keyboard.press('Control+Shift+C');
    await page
      .locator('#command-palette .lm-CommandPalette-input')
      .fill('snapshot kernel');
    await expect(
      page.locator('#command-palette .lm-CommandPalette-item', {
        hasText: 'Snapshot Kernel'
      })
    ).toBeVisible();
    await page.keyboard.press('Escape');
  });

  test('hides the Snapshot button for kernels Infinijup does not manage', async ({
    page
  }) => {
    backend.managed = false;
    await createNotebook(page, 'unmanaged.ipynb');
    await currentKernelId(page);
    await expect
      .poll(() =>
        backend.requests.some(r => r.startsWith('GET /infinijup/status'))
      )
      .toBe(true);
    await expect(
      page.locator(
        '.jp-NotebookPanel:not(.lm-mod-hidden) [data-jp-item-name="infinijup-snapshot"]'
      )
    ).toBeHidden();
    await openHistory(page);
    await expect(
      page
        .locator('#infinijup-history .jp-Infinijup-notice')
        .filter({ hasText: 'not managed' })
    ).toContainText('Python 3 (Infinijup)');
  });

  test('snapshot: progress from events, then the result', async ({ page }) => {
    await createNotebook(page, 'progress.ipynb');
    const kernelId = await currentKernelId(page);
    await expect.poll(() => backend.socketCount).toBeGreaterThan(0);

    let release!: () => void;
    const released = new Promise<void>(resolve => (release = resolve));
    backend.onSnapshot = async route => {
      await released;
      await route.fulfill({
        status: 201,
        json: {
          commit: 'cafebabe'.repeat(8),
          thread: 'main',
          parents: [],
          stats: {
            image_bytes: 3 << 30,
            stored_bytes: 300 << 20,
            pause_s: 1.25,
            duration_s: 4
          }
        }
      });
    };

    await page
      .locator(
        '.jp-NotebookPanel:not(.lm-mod-hidden) [data-jp-item-name="infinijup-snapshot"]'
      )
      .click();
    await expect(
      toasts(page).filter({ hasText: 'Snapshot of progress.ipynb' })
    ).toBeVisible();

    const ev = {
      op: 'snapshot',
      op_id: 'op-1',
      kernel_id: kernelId,
      path: 'progress.ipynb'
    };
    backend.emit({ ...ev, phase: 'quiesce', percent: 5, message: '' });
    backend.emit({ ...ev, phase: 'dump', percent: 50, message: '3.0 GiB' });
    // The phase and a progress bar (JupyterLab toasts show text: a text bar).
    const toast = toasts(page).filter({
      hasText: 'Dumping the process █████░░░░░ 50%'
    });
    await expect(toast).toBeVisible();
    await expect(toast).toContainText('3.0 GiB');
    // The history panel shows the running operation with a progress element.
    await openHistory(page);
    await expect(
      page.locator('.jp-Infinijup-operation progress')
    ).toHaveAttribute('value', '50');

    backend.emit({
      ...ev,
      phase: 'done',
      percent: 100,
      message: '',
      commit: 'cafebabe'.repeat(8),
      thread: 'main'
    });
    release();
    await expect(
      toasts(page).filter({ hasText: 'Snapshot cafebabe saved on main' })
    ).toBeVisible();
    expect(backend.bodies.snapshot).toEqual([{ kernel_id: kernelId }]);
  });

  test("restore error: the notification shows the server's message and reason", async ({
    page
  }) => {
    backend.history = demoHistory(Math.floor(Date.now() / 1000));
    await createNotebook(page, 'error.ipynb');
    await currentKernelId(page);
    backend.onRestore = route =>
      route.fulfill({
        status: 500,
        json: {
          message: 'pack 3f2a9c1e is damaged',
          reason: 'checksum_mismatch'
        }
      });
    await execute(page, 'infinijup:restore', { commit: hex('m2') });
    await page
      .locator('.jp-Dialog')
      .getByRole('button', { name: 'Restore' })
      .click();
    await expect(
      toasts(page).filter({
        hasText:
          'Restore of error.ipynb failed: pack 3f2a9c1e is damaged (checksum_mismatch)'
      })
    ).toBeVisible();
  });

  test('gpu_mismatch: restore anyway sends force', async ({ page }) => {
    backend.history = demoHistory(Math.floor(Date.now() / 1000));
    await createNotebook(page, 'gpu.ipynb');
    const kernelId = await currentKernelId(page);
    backend.onRestore = (route, body) =>
      body.force
        ? route.fulfill({
            json: {
              kernel_id: body.kernel_id,
              commit: body.commit,
              thread: 'main',
              duration_s: 3
            }
          })
        : route.fulfill({
            status: 422,
            json: {
              message:
                'snapshot taken on 1x NVIDIA H100, this machine has 1x NVIDIA H200',
              reason: 'gpu_mismatch'
            }
          });
    await execute(page, 'infinijup:restore', { commit: hex('m3') });
    await page
      .locator('.jp-Dialog')
      .getByRole('button', { name: 'Restore' })
      .click();
    await expect(
      toasts(page).filter({ hasText: '(gpu_mismatch)' })
    ).toBeVisible();
    const dialog = page.locator('.jp-Dialog');
    await expect(dialog).toContainText('this machine has 1x NVIDIA H200');
    await dialog.getByRole('button', { name: 'Restore anyway' }).click();
    await expect(
      toasts(page).filter({ hasText: `Restored ${hex('m3').slice(0, 8)}` })
    ).toBeVisible();
    expect(backend.bodies.restore).toEqual([
      { kernel_id: kernelId, commit: hex('m3') },
      { kernel_id: kernelId, commit: hex('m3'), force: true }
    ]);
  });

  test('a missing server extension is reported as such', async ({ page }) => {
    // What tornado answers for a route nobody registered.
    backend.onSnapshot = route =>
      route.fulfill({
        status: 404,
        contentType: 'text/html',
        body: '<html>404: Not Found</html>'
      });
    await createNotebook(page, 'missing.ipynb');
    await currentKernelId(page);
    await execute(page, 'infinijup:snapshot');
    await expect(
      toasts(page).filter({
        hasText:
          'Snapshot of missing.ipynb failed: The Infinijup server extension is not available'
      })
    ).toContainText('(extension_missing)');
    // The whole error is one click away.
    await toasts(page).getByRole('button', { name: 'Details' }).click();
    await expect(page.locator('.jp-Dialog')).toContainText(
      'jupyter server extension list'
    );
  });

  test('draws a history of 1000 commits, virtualized and collapsible', async ({
    page
  }, testInfo) => {
    backend.history = syntheticHistory(1000, { seed: 7, maxThreads: 6 }) as any;
    await createNotebook(page, 'big.ipynb');
    await currentKernelId(page);
    await openHistory(page);
    const graph = page.locator('#infinijup-history .jp-Infinijup-graph');
    await expect(graph).toHaveAttribute('data-rows', /\d+/);
    const collapsedRows = Number(await graph.getAttribute('data-rows'));
    expect(collapsedRows).toBeLessThan(1000);

    // Only the rows near the viewport are in the DOM.
    const rendered = await graph.locator('.jp-Infinijup-row').count();
    expect(rendered).toBeGreaterThan(5);
    expect(rendered).toBeLessThan(80);

    // Expanding a collapsed run adds its rows.
    const run = graph.locator('.jp-Infinijup-row.jp-mod-collapsed').first();
    await run.click();
    await expect
      .poll(async () => Number(await graph.getAttribute('data-rows')))
      .toBeGreaterThan(collapsedRows);

    // Unfold all with the labelled toggle: every commit is a row; scrolling
    // to the end renders the end.
    const fold = page
      .locator('#infinijup-history')
      .getByRole('checkbox', { name: 'Fold runs' });
    await expect(fold).toBeChecked();
    await fold.uncheck();
    await expect(graph).toHaveAttribute('data-rows', '1000');
    await graph.evaluate(node => (node.scrollTop = node.scrollHeight));
    await expect(
      graph.locator('.jp-Infinijup-row[data-row="999"]')
    ).toBeAttached();
    expect(await graph.locator('.jp-Infinijup-row').count()).toBeLessThan(80);

    // The head commit is marked; selecting a commit shows its details.
    await graph.evaluate(node => (node.scrollTop = 0));
    await expect(graph.locator('.jp-Infinijup-row.jp-mod-head')).toHaveCount(1);
    const head = backend.history.head!.commit!;
    await graph.locator(`.jp-Infinijup-row[data-commit-id="${head}"]`).click();
    const details = page.locator('.jp-Infinijup-details');
    await expect(details.locator('.jp-Infinijup-fullid')).toHaveText(head);
    await expect(
      details.getByRole('button', { name: 'Restore' })
    ).toBeVisible();
    await expect(
      details.getByRole('button', { name: 'Branch from here' })
    ).toBeVisible();
    await expect(
      details.getByRole('button', { name: 'Copy id' })
    ).toBeVisible();

    await page
      .locator('#infinijup-history')
      .screenshot({ path: testInfo.outputPath('history-panel-1000.png') });
  });

  test('panel: restore and branch from a node, live updates from events', async ({
    page
  }, testInfo) => {
    const now = Math.floor(Date.now() / 1000);
    backend.history = demoHistory(now);
    await createNotebook(page, 'demo.ipynb');
    const kernelId = await currentKernelId(page);
    await openHistory(page);
    await widenRightPanel(page);
    const graph = page.locator('#infinijup-history .jp-Infinijup-graph');
    await expect(graph.locator('.jp-Infinijup-row')).toHaveCount(10);
    await expect(graph.locator('.jp-Infinijup-chip-thread')).toHaveCount(3);
    await expect(graph.locator('.jp-Infinijup-chip-gpu')).toHaveCount(7);

    // Select the first epoch on main.
    await graph
      .locator(`.jp-Infinijup-row[data-commit-id="${hex('m4')}"]`)
      .click();
    await expect(page.locator('.jp-Infinijup-details')).toContainText(
      '[10] losses = train(model, opt, epochs=1)'
    );
    await screenshot(
      page.locator('#infinijup-history'),
      testInfo,
      'history-panel'
    );

    // Restore from the details pane.
    await page
      .locator('.jp-Infinijup-details')
      .getByRole('button', { name: 'Restore' })
      .click();
    await page
      .locator('.jp-Dialog')
      .getByRole('button', { name: 'Restore' })
      .click();
    await expect(
      toasts(page).filter({ hasText: `Restored ${hex('m4').slice(0, 8)}` })
    ).toBeVisible();
    expect(backend.bodies.restore[0]).toEqual({
      kernel_id: kernelId,
      commit: hex('m4')
    });

    // Branch from the context menu of a row.
    await graph
      .locator(`.jp-Infinijup-row[data-commit-id="${hex('m2')}"]`)
      .click({ button: 'right' });
    await page.locator('.lm-Menu').getByText('Branch from Here…').click();
    await page.locator('.jp-Dialog input').fill('my-branch');
    await page
      .locator('.jp-Dialog')
      .getByRole('button', { name: 'Next' })
      .click();
    await page
      .locator('.jp-Dialog')
      .getByRole('button', { name: 'Branch' })
      .click();
    await expect(
      toasts(page).filter({ hasText: 'into new thread my-branch' })
    ).toBeVisible();
    expect(backend.bodies.restore[1]).toEqual({
      kernel_id: kernelId,
      commit: hex('m2'),
      branch: 'my-branch'
    });

    // A snapshot made elsewhere (%snapshot, another tab): the panel updates.
    const history = demoHistory(now);
    history.commits.unshift(
      commit(hex('m7'), [hex('m6')], 'main', now, 'from %snapshot')
    );
    history.threads.main = hex('m7');
    history.head = { thread: 'main', commit: hex('m7') };
    backend.history = history;
    backend.emit({
      op: 'snapshot',
      op_id: 'magic-1',
      kernel_id: kernelId,
      path: 'demo.ipynb',
      phase: 'done',
      percent: 100,
      message: '',
      commit: hex('m7'),
      thread: 'main'
    });
    await expect(graph.locator('.jp-Infinijup-row')).toHaveCount(11);
    await expect(graph.locator('.jp-Infinijup-row').first()).toContainText(
      'from %snapshot'
    );
    await expect(graph.locator('.jp-Infinijup-row.jp-mod-head')).toContainText(
      'from %snapshot'
    );
  });
});

test.describe('Infinijup settings @mocked', () => {
  let backend: MockBackend;

  test.use({
    mockSettings: {
      ...galata.DEFAULT_SETTINGS,
      'infinijup:plugin': { askMessage: true, confirmRestore: false }
    }
  });

  test.beforeEach(async ({ page }) => {
    backend = new MockBackend();
    await backend.install(page);
    await page.goto();
  });

  test('asks for a message (shortcut Accel Alt S) and restores without confirmation', async ({
    page
  }) => {
    backend.history = demoHistory(Math.floor(Date.now() / 1000));
    await createNotebook(page, 'settings.ipynb');
    const kernelId = await currentKernelId(page);
    await expect(
      page.locator(
        '.jp-NotebookPanel:not(.lm-mod-hidden) [data-jp-item-name="infinijup-snapshot"]'
      )
    ).toBeVisible();

    // Command mode, then the shortcut.
    await page.notebook.selectCells(0);
    await page.keyboard.press('Escape');
    await page.keyboard.press('Control+Alt+s');
    const dialog = page.locator('.jp-Dialog');
    await expect(dialog).toContainText(
      'Message for the snapshot of settings.ipynb'
    );
    await dialog.locator('input').fill('after loading the data');
    await dialog.getByRole('button', { name: 'Snapshot' }).click();
    await expect(
      toasts(page).filter({ hasText: 'saved on main' })
    ).toBeVisible();
    expect(backend.bodies.snapshot).toEqual([
      { kernel_id: kernelId, message: 'after loading the data' }
    ]);

    // confirmRestore: false, so no dialog.
    await execute(page, 'infinijup:restore', { commit: hex('m2') });
    await expect(
      toasts(page).filter({ hasText: `Restored ${hex('m2').slice(0, 8)}` })
    ).toBeVisible();
    await expect(page.locator('.jp-Dialog')).toHaveCount(0);
  });
});
