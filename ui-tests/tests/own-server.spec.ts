/**
 * The UI tests run against the JupyterLab this run started (issue 16): a
 * server already listening on a port (a developer's `make lab`, another run)
 * is never reused. The runner gives each run an id that its server writes to
 * infinijup-ui-run.txt at its root; a foreign server has another id or none.
 */

import { expect, test } from '@jupyterlab/galata';

test('the server under test is the one this run started @mocked', async ({
  page,
  baseURL
}) => {
  const runId = process.env.INFINIJUP_UI_RUN_ID;
  expect(runId, 'playwright.config.js sets INFINIJUP_UI_RUN_ID').toMatch(
    /^[0-9a-f]{16}$/
  );
  expect(baseURL).toBe(`http://localhost:${process.env.INFINIJUP_UI_PORT}`);
  const response = await page.request.get(
    '/api/contents/infinijup-ui-run.txt?content=1&type=file&format=text'
  );
  expect(response.status()).toBe(200);
  expect((await response.json()).content).toBe(runId);
});
