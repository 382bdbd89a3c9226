/**
 * What the UI says (issue 18), with the Infinijup API mocked: where the next
 * snapshot goes (toast and headline), why a plain kernel cannot be
 * snapshotted, the restore picker, rows and toasts at the default panel
 * width, the fold toggle, branching at HEAD, the launcher's kernel logo.
 */

import { expect, test } from '@jupyterlab/galata';

import {
  createNotebook,
  currentKernelId,
  demoHistory,
  execute,
  hex,
  MockBackend,
  openHistory,
  overlaps,
  screenshot,
  toasts
} from './helpers';

test.use({ autoGoto: false });

const short = (tag: string) => hex(tag).slice(0, 8);

test.describe('What the UI says @mocked', () => {
  let backend: MockBackend;

  test.beforeEach(async ({ page }) => {
    backend = new MockBackend();
    backend.history = demoHistory(Math.floor(Date.now() / 1000));
    await backend.install(page);
    await page.goto();
  });

  test('after restoring an older commit, the toast and the headline say where the next snapshot goes', async ({
    page
  }, testInfo) => {
    await createNotebook(page, 'next.ipynb');
    const kernelId = await currentKernelId(page);
    await openHistory(page);
    const headline = page.locator('#infinijup-history .jp-Infinijup-headline');
    await expect(headline).toHaveText(
      `HEAD ${short('m6')} · next snapshot on main`
    );

    // The server's reply after restoring m4, which is no thread's tip.
    backend.onRestore = async (route, body) => {
      backend.history = {
        ...backend.history,
        head: { thread: null, commit: body.commit, next_thread: 'main-1' }
      };
      await route.fulfill({
        json: {
          kernel_id: body.kernel_id,
          commit: body.commit,
          thread: null,
          duration_s: 0.46
        }
      });
    };
    await page
      .locator(`.jp-Infinijup-row[data-commit-id="${hex('m4')}"]`)
      .click();
    const card = page.locator('#infinijup-history .jp-Infinijup-details');
    await card.getByRole('button', { name: 'Restore' }).click();
    await page
      .locator('.jp-Dialog')
      .getByRole('button', { name: 'Restore' })
      .click();
    const toast = toasts(page).filter({ hasText: `Restored ${short('m4')}` });
    await expect(toast).toContainText(
      `Restored ${short('m4')} in 460 ms · next snapshot starts new thread main-1`
    );
    await expect(toast).not.toContainText('null');
    await expect(headline).toHaveText(
      `HEAD ${short('m4')} (not a thread tip) · next snapshot starts new thread main-1`
    );
    expect(backend.bodies.restore).toEqual([
      { kernel_id: kernelId, commit: hex('m4') }
    ]);

    // The toast does not cover the card's buttons (the card is on top).
    const toastBox = (await toast.boundingBox())!;
    for (const button of await card.locator('button').all()) {
      const box = (await button.boundingBox())!;
      expect(overlaps(box, toastBox), await button.innerText()).toBe(false);
    }
    const panel = (await page.locator('#infinijup-history').boundingBox())!;
    await screenshot(page, testInfo, 'restore-next-thread', {
      clip: {
        x: Math.min(panel.x, toastBox.x) - 4,
        y: panel.y,
        width: panel.x + panel.width - Math.min(panel.x, toastBox.x) + 4,
        height: Math.min(
          toastBox.y + toastBox.height + 8 - panel.y,
          panel.height
        )
      }
    });
  });

  test('on a plain kernel the shortcut says why, and the panel says only how to switch', async ({
    page
  }, testInfo) => {
    backend.managed = false;
    backend.history = { commits: [], threads: {}, head: null };
    await createNotebook(page, 'plain.ipynb');
    await currentKernelId(page);
    await expect
      .poll(() =>
        backend.requests.some(r => r.startsWith('GET /infinijup/status'))
      )
      .toBe(true);
    await openHistory(page);
    const status = page.locator('#infinijup-history .jp-Infinijup-status');
    await expect(status).toContainText('is not managed by Infinijup');
    await expect(status).toContainText('Python 3 (ipykernel)');
    await expect(
      status.getByRole('button', { name: 'Change Kernel…' })
    ).toBeVisible();
    await expect(status).not.toContainText('Press Snapshot');
    await expect(status).not.toContainText('%snapshot');

    // Ctrl+Alt+S in command mode: a notification says why.
    await page.notebook.selectCells(0);
    await page.keyboard.press('Escape');
    await page.keyboard.press('Control+Alt+s');
    const toast = toasts(page).filter({
      hasText: 'Cannot snapshot (plain.ipynb): its kernel'
    });
    await expect(toast).toContainText('is not managed by Infinijup');
    await expect(toast).toContainText('Python 3 (Infinijup)');
    await expect(
      toast.getByRole('button', { name: 'Change Kernel…' })
    ).toBeVisible();
    expect(backend.bodies.snapshot).toEqual([]);
    await screenshot(
      page.locator('#infinijup-history'),
      testInfo,
      'plain-kernel'
    );
  });

  test('the restore picker preselects HEAD with whole labels; an unknown id is refused before any confirmation', async ({
    page
  }, testInfo) => {
    backend.history.head = {
      thread: null,
      commit: hex('m4'),
      next_thread: 'main-1'
    };
    await createNotebook(page, 'picker.ipynb');
    await currentKernelId(page);
    await execute(page, 'infinijup:restore');
    const dialog = page.locator('.jp-Dialog');
    const list = dialog.getByRole('listbox', { name: 'Snapshots' });
    const selected = list.locator('[role="option"][aria-selected="true"]');
    await expect(selected).toHaveCount(1);
    await expect(selected).toHaveAttribute('data-id', hex('m4')); // HEAD, not the newest
    await expect(selected).toContainText(
      `HEAD${short('m4')}[10] losses = train(model, opt, epochs=1)`
    );
    await expect(selected).toBeInViewport();
    // Ids, HEAD and ages are whole; only a long label gives way (ellipsis),
    // and nothing runs past the list.
    const cut = await list.evaluate(node => {
      const out: string[] = [];
      const right = node.getBoundingClientRect().right;
      node
        .querySelectorAll<HTMLElement>(
          '.jp-Infinijup-id, .jp-Infinijup-chip, .jp-Infinijup-picker-age'
        )
        .forEach(el => {
          if (
            el.scrollWidth > el.clientWidth + 1 ||
            el.getBoundingClientRect().right > right
          ) {
            out.push(el.textContent ?? '');
          }
        });
      if (node.scrollWidth > node.clientWidth) {
        out.push('list overflows');
      }
      return out;
    });
    expect(cut).toEqual([]);
    await screenshot(dialog.locator('.jp-Dialog-content'), testInfo, 'picker');

    await dialog.locator('input.jp-Infinijup-picker-input').fill('deadbeef');
    await dialog.getByRole('button', { name: 'Next' }).click();
    await expect(
      toasts(page).filter({
        hasText: 'No snapshot “deadbeef” in the history of picker.ipynb'
      })
    ).toBeVisible();
    await expect(page.locator('.jp-Dialog')).toHaveCount(0);
    expect(backend.bodies.restore).toEqual([]);
  });

  test('at the default width rows show id and age whole; a toggle labelled Fold runs', async ({
    page
  }, testInfo) => {
    await createNotebook(page, 'narrow.ipynb');
    await currentKernelId(page);
    await openHistory(page);
    const panel = page.locator('#infinijup-history');
    const width = (await panel.boundingBox())!.width;
    expect(width).toBeLessThan(300); // JupyterLab's default sidebar width
    const rows = panel.locator('.jp-Infinijup-row');
    await expect(rows).toHaveCount(10);
    const cut = await panel.evaluate(node =>
      Array.from(
        node.querySelectorAll<HTMLElement>(
          '.jp-Infinijup-id, .jp-Infinijup-age, .jp-Infinijup-size, .jp-Infinijup-chip'
        )
      )
        .filter(el => el.offsetParent !== null) // shown
        .filter(el => {
          const meta = el.closest(
            '.jp-Infinijup-row-meta, .jp-Infinijup-row-line'
          )!;
          const box = el.getBoundingClientRect();
          const limit = meta.getBoundingClientRect();
          return (
            el.scrollWidth > el.clientWidth + 1 || box.right > limit.right + 0.5
          );
        })
        .map(el => el.textContent)
    );
    expect(cut).toEqual([]);
    // Ages read as ages, not "ju…".
    await expect(rows.first().locator('.jp-Infinijup-age')).toHaveText('4m');
    const fold = panel.getByRole('checkbox', { name: 'Fold runs' });
    await expect(fold).toBeVisible();
    await expect(fold).toBeChecked();
    await screenshot(panel, testInfo, 'history-panel-narrow');
  });

  test('branch from HEAD starts a thread without a warning and leaves the kernel alone', async ({
    page
  }) => {
    await createNotebook(page, 'branch-head.ipynb');
    const kernelId = await currentKernelId(page);
    await openHistory(page);
    await page
      .locator(`.jp-Infinijup-row[data-commit-id="${hex('m6')}"]`)
      .click();
    await page
      .locator('#infinijup-history .jp-Infinijup-details')
      .getByRole('button', { name: 'Branch from here' })
      .click();
    const dialog = page.locator('.jp-Dialog');
    await dialog.locator('input').fill('plots');
    await dialog.getByRole('button', { name: 'Next' }).click();
    await expect(
      toasts(page).filter({ hasText: 'New thread plots at' })
    ).toContainText('the kernel was not touched');
    await expect(page.locator('.jp-Dialog')).toHaveCount(0);
    expect(backend.bodies.branch).toEqual([
      { kernel_id: kernelId, name: 'plots' }
    ]);
    expect(backend.bodies.restore).toEqual([]);
  });

  test('the launcher shows the Infinijup kernel with its logo', async ({
    page
  }, testInfo) => {
    await page
      .getByRole('button', { name: /^New Launcher/ })
      .first()
      .click();
    const card = page
      .locator('.jp-LauncherCard[title="Python 3 (Infinijup)"]:visible')
      .first();
    await expect(card).toBeVisible();
    const img = card.locator('.jp-LauncherCard-icon img');
    // JupyterLab prefers the SVG logo of a kernelspec.
    await expect(img).toHaveAttribute(
      'src',
      /kernelspecs\/infinijup\/logo-svg\.svg$/
    );
    // The image loads (a missing file would leave naturalWidth 0).
    await expect
      .poll(() => img.evaluate((el: HTMLImageElement) => el.naturalWidth))
      .toBe(64);
    await expect(card.locator('.jp-LauncherCard-noKernelIcon')).toHaveCount(0);
    await screenshot(card, testInfo, 'launcher-tile');
  });
});
