/**
 * Resume (issue 11) in the Lab UI, with the Infinijup API mocked: the mock's
 * POST /infinijup/resume does what the server does to the Jupyter side (a
 * session with a new kernel at the notebook's path, or at a copy of the
 * notebook), so the frontend's part is real: the history of a notebook
 * without a kernel, "Resume here", "Open in new notebook".
 *
 * The same stories against the real server are in backend.spec.ts.
 */

import { expect, test } from '@jupyterlab/galata';

import {
  createNotebook,
  currentKernelId,
  demoHistory,
  hex,
  MockBackend,
  notified,
  openHistory,
  screenshot
} from './helpers';

test.use({ autoGoto: false });

const short = (tag: string) => hex(tag).slice(0, 8);

/** The current notebook's kernel id, or null. */
function kernelIdOf(page: any, path: string): Promise<string | null> {
  return page.evaluate((p: string) => {
    const app = (window as any).jupyterapp;
    const widget = app.shell.widgets
      ? Array.from(app.shell.widgets('main')).find(
          (w: any) => w.context?.path === p
        )
      : null;
    return (widget as any)?.sessionContext?.session?.kernel?.id ?? null;
  }, path);
}

test.describe('Resume @mocked', () => {
  let backend: MockBackend;

  test.beforeEach(async ({ page }) => {
    // Each resume starts a real kernel (the mock's), beside the Python suite
    // in `make test` on a busy machine.
    test.slow();
    backend = new MockBackend();
    const history = demoHistory(Math.floor(Date.now() / 1000));
    // A path query has no kernel: the server reports no head commit.
    history.head = { thread: 'main', commit: null, next_thread: 'main' };
    backend.history = history;
    await backend.install(page);
    await page.goto();
  });

  test('a notebook without a kernel shows its history; Resume here starts a kernel from a snapshot', async ({
    page
  }, testInfo) => {
    await createNotebook(page, 'resume.ipynb');
    const oldKernel = await currentKernelId(page);
    await page.evaluate(() =>
      (window as any).jupyterapp.shell.currentWidget.sessionContext.shutdown()
    );
    await expect.poll(() => kernelIdOf(page, 'resume.ipynb')).toBeNull();
    await openHistory(page);
    const panel = page.locator('#infinijup-history');
    await expect(panel.locator('.jp-Infinijup-row')).toHaveCount(10);
    await expect(panel.locator('.jp-Infinijup-status')).toContainText(
      'No kernel is running'
    );
    expect(
      backend.requests.some(r =>
        r.startsWith('GET /infinijup/history?path=resume.ipynb&')
      )
    ).toBe(true);
    await panel
      .locator(`.jp-Infinijup-row[data-commit-id="${hex('m4')}"]`)
      .click();
    const card = panel.locator('.jp-Infinijup-details');
    await expect(card.getByRole('button', { name: 'Restore' })).toHaveCount(0);
    await screenshot(panel, testInfo, 'no-kernel');

    await card.getByRole('button', { name: 'Resume here' }).click();
    await notified(page, `Resumed ${short('m4')} in a new kernel`);
    expect(backend.bodies.resume).toEqual([
      { path: 'resume.ipynb', commit: hex('m4') }
    ]);
    // The notebook runs the kernel the server started for it.
    const sessions = await (await page.request.get('/api/sessions')).json();
    const started = sessions
      .filter((s: any) => s.path === 'resume.ipynb')
      .map((s: any) => s.kernel.id);
    const now = await kernelIdOf(page, 'resume.ipynb');
    expect(now).not.toBeNull();
    expect(now).not.toBe(oldKernel);
    expect(started).toContain(now);
    // No confirmation was needed: nothing was running.
    await expect(page.locator('.jp-Dialog')).toHaveCount(0);
  });

  test('Open in new notebook resumes a snapshot next to the open notebook', async ({
    page
  }) => {
    await createNotebook(page, 'opennew.ipynb');
    const kernelId = await currentKernelId(page);
    await openHistory(page);
    await page
      .locator(
        `#infinijup-history .jp-Infinijup-row[data-commit-id="${hex('m2')}"]`
      )
      .click();
    await page
      .locator('#infinijup-history .jp-Infinijup-details')
      .getByRole('button', { name: 'Open in new notebook' })
      .click();
    const copy = `opennew-${short('m2')}.ipynb`;
    await notified(page, `Opened ${short('m2')} in ${copy}`);
    expect(backend.bodies.resume).toEqual([
      {
        path: 'opennew.ipynb',
        commit: hex('m2'),
        new_notebook: true,
        session: false
      }
    ]);
    // A new tab with the copy, on the kernel the server started for it; the
    // first notebook keeps its kernel.
    await expect(
      page.locator(`.lm-TabBar-tab[title*="${copy}"]`).first()
    ).toBeVisible();
    const sessions = await (await page.request.get('/api/sessions')).json();
    const started = sessions.find((s: any) => s.path === copy)?.kernel.id;
    expect(started).toBeTruthy();
    await expect.poll(() => kernelIdOf(page, copy)).toBe(started);
    expect(await kernelIdOf(page, 'opennew.ipynb')).toBe(kernelId);
  });
});
