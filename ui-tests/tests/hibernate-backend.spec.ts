/**
 * Hibernation (issue 14) end to end: a real JupyterLab with the Infinijup
 * server extension, a real Infinijup kernel, CRIU and the helper. The Lab
 * command hibernates the kernel (snapshot, then no process), the notebook
 * shows "Hibernated"; the next cell wakes it ("Waking…"), runs, and sees the
 * variables of before.
 *
 * Needs what backend.spec.ts needs (pip install -e ., CRIU, the helper daemon).
 * The kernel is checked to be managed first: without the backend this fails,
 * it never passes vacuously.
 */

import { expect, IJupyterLabPageFixture, test } from '@jupyterlab/galata';

import { execute, openHistory, waitForKernelIdle } from './helpers';

const RUN = Date.now().toString(36);

/** A CRIU dump or restore takes seconds, more on a busy machine. */
const OP_TIMEOUT = 120_000;

const TOOLBAR_REST =
  '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Infinijup-rest-toolbar';

/** A notebook on the Infinijup kernel (as in backend.spec.ts). */
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
    'GET /infinijup/status must answer 200: is the infinijup server extension installed and enabled?'
  ).toBe(200);
  const status = await response.json();
  expect(status.managed, 'the kernel must run under Infinijup').toBe(true);
  expect(status.state, 'a server that knows hibernation').toBe('running');
  return { kernelId: kernelId!, name };
}

/** Run code in a new cell at the end; return its text output. */
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

async function serverState(
  page: IJupyterLabPageFixture,
  kernelId: string
): Promise<string> {
  const response = await page.request.get(
    `/infinijup/status?kernel_id=${kernelId}`
  );
  return (await response.json()).state;
}

test.describe('Hibernation end to end @backend', () => {
  test('Hibernate Kernel shows Hibernated; the next cell wakes it (Waking…) and x is still 1', async ({
    page,
    tmpPath
  }) => {
    test.setTimeout(6 * OP_TIMEOUT);
    const { kernelId } = await infinijupNotebook(page, tmpPath, 'hibernate');
    await openHistory(page);
    expect(await run(page, 'x = 1\nx')).toBe('1');
    const indicator = page.locator(TOOLBAR_REST);
    await expect(indicator).toHaveAttribute('data-rest-state', 'running');
    await expect(indicator).toBeHidden();

    const reply = page.waitForResponse(
      r =>
        /\/infinijup\/hibernate(\?|$)/.test(r.url()) &&
        r.request().method() === 'POST',
      { timeout: OP_TIMEOUT }
    );
    await execute(page, 'infinijup:hibernate');
    const response = await reply;
    const body = await response.json();
    expect(response.status(), JSON.stringify(body)).toBe(200);
    expect(body).toMatchObject({ kernel_id: kernelId, state: 'hibernated' });
    await expect(indicator).toHaveText('Hibernated');
    await expect(
      page.locator('#infinijup-history .jp-Infinijup-rest-banner')
    ).toHaveText('Hibernated');
    await expect(
      page.locator('#jp-main-statusbar .jp-Infinijup-rest-statusbar')
    ).toHaveText('Hibernated');
    expect(await serverState(page, kernelId)).toBe('hibernated');

    // Every state the toolbar's indicator goes through, however briefly.
    await page.evaluate(selector => {
      const node = document.querySelector(selector) as HTMLElement;
      const seen: string[] = [node.dataset.restState ?? ''];
      (window as any).__infinijupRestSeen = seen;
      new MutationObserver(records => {
        for (const r of records) {
          seen.push(r.oldValue ?? '');
        }
        seen.push(node.dataset.restState ?? '');
      }).observe(node, {
        attributes: true,
        attributeFilter: ['data-rest-state'],
        attributeOldValue: true
      });
    }, TOOLBAR_REST);

    // The next cell wakes the kernel; it runs in the state of before.
    expect(await run(page, 'x + 1')).toBe('2');
    await expect(page.locator(TOOLBAR_REST)).toHaveAttribute(
      'data-rest-state',
      'running',
      { timeout: OP_TIMEOUT }
    );
    await expect(page.locator(TOOLBAR_REST)).toBeHidden();
    const seen: string[] = await page.evaluate(
      () => (window as any).__infinijupRestSeen
    );
    // hibernated -> waking -> running, in that order.
    const order = seen.filter((s, i) => s && s !== seen[i - 1]);
    expect(order).toEqual(['hibernated', 'waking', 'running']);
    expect(await serverState(page, kernelId)).toBe('running');
    // Same kernel, idle.
    await waitForKernelIdle(page);
    const now = await page.evaluate(
      () =>
        (window as any).jupyterapp.shell.currentWidget.sessionContext.session
          .kernel.id
    );
    expect(now).toBe(kernelId);
  });
});
