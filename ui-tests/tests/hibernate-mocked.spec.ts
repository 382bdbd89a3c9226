/**
 * Hibernation (issue 14) in the Lab UI, with the Infinijup API mocked: the
 * kernel's rest state ("GPU released", "Hibernated", "Waking… 40%") in the
 * notebook toolbar, the status bar and the Kernel history panel, driven by
 * injected events and by GET /infinijup/status; the Hibernate Kernel command
 * (Kernel menu, palette) and its 409 error; a click on "Hibernated" wakes.
 *
 * The same story against the real server is in hibernate-backend.spec.ts.
 * Screenshots: rest-released, rest-hibernated, rest-waking.
 */

import { expect, test } from '@jupyterlab/galata';
import type { Page, Route } from '@playwright/test';

import {
  createNotebook,
  currentKernelId,
  MockBackend,
  openHistory,
  screenshot,
  toasts
} from './helpers';

test.use({ autoGoto: false });

/** The mocked hibernation endpoints (they take precedence over MockBackend's). */
class MockRest {
  /** What GET /infinijup/status says of every kernel. */
  state = 'running';
  bodies: { hibernate: any[]; wake: any[] } = { hibernate: [], wake: [] };
  onHibernate: (route: Route, body: any) => Promise<void> | void = (
    route,
    body
  ) =>
    route.fulfill({
      json: {
        kernel_id: body.kernel_id,
        state: 'hibernated',
        commit: 'cd'.repeat(32)
      }
    });
  onWake: (route: Route, body: any) => Promise<void> | void = (route, body) =>
    route.fulfill({ json: { kernel_id: body.kernel_id, state: 'running' } });

  async install(page: Page): Promise<void> {
    await page.route(/\/infinijup\/(status|hibernate|wake)(\?.*)?$/, route => {
      const request = route.request();
      const url = new URL(request.url());
      const endpoint = url.pathname.split('/').pop()!;
      if (endpoint === 'status') {
        return route.fulfill({
          json: {
            kernel_id: url.searchParams.get('kernel_id'),
            managed: true,
            state: this.state,
            operation: null,
            head: { thread: 'main', commit: 'ab'.repeat(32) }
          }
        });
      }
      const body = request.postDataJSON();
      if (endpoint === 'hibernate') {
        this.bodies.hibernate.push(body);
        return this.onHibernate(route, body);
      }
      this.bodies.wake.push(body);
      return this.onWake(route, body);
    });
  }
}

/** The three places that show the rest state, for the current notebook. */
function indicators(page: Page) {
  return {
    toolbar: page.locator(
      '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Infinijup-rest-toolbar'
    ),
    statusbar: page.locator('#jp-main-statusbar .jp-Infinijup-rest-statusbar'),
    panel: page.locator('#infinijup-history .jp-Infinijup-rest-banner')
  };
}

async function expectRest(page: Page, state: string, text: string | null) {
  for (const [where, locator] of Object.entries(indicators(page))) {
    await expect(locator, where).toHaveAttribute('data-rest-state', state);
    if (text === null) {
      await expect(locator, where).toBeHidden();
    } else {
      await expect(locator, where).toBeVisible();
      await expect(locator, where).toHaveText(text);
    }
  }
}

/** The notebook toolbar's right end and the history panel's top. */
async function shotRest(page: Page, testInfo: any, name: string) {
  const toolbar = await indicators(page).toolbar.boundingBox();
  const panel = await page.locator('#infinijup-history').boundingBox();
  expect(toolbar && panel).toBeTruthy();
  const x = toolbar!.x - 160;
  const y = Math.min(toolbar!.y - 6, panel!.y);
  await screenshot(page, testInfo, name, {
    clip: { x, y, width: panel!.x + panel!.width - x, height: 170 }
  });
}

test.describe('Hibernation @mocked', () => {
  let backend: MockBackend;
  let rest: MockRest;

  test.beforeEach(async ({ page }) => {
    backend = new MockBackend();
    await backend.install(page);
    rest = new MockRest();
    await rest.install(page);
    await page.goto();
  });

  test('GPU released, Hibernated, Waking… with progress, from events; a click on Hibernated wakes', async ({
    page
  }, testInfo) => {
    await createNotebook(page, 'rest.ipynb');
    const kernelId = await currentKernelId(page);
    await openHistory(page);
    // Running: nothing extra.
    await expectRest(page, 'running', null);
    const ev = (op: string, phase: string, extra: object = {}) =>
      backend.emit({
        op,
        op_id: `${op}-1`,
        kernel_id: kernelId,
        path: '',
        phase,
        percent: phase === 'done' || phase === 'error' ? 100 : 0,
        ...extra
      });

    ev('release', 'done', { kernel_state: 'released' });
    await expectRest(page, 'released', 'GPU released');
    await shotRest(page, testInfo, 'rest-released');

    ev('wake', 'queued', { kernel_state: 'waking' });
    await expectRest(page, 'waking', 'Waking…');
    ev('wake', 'done', { kernel_state: 'running' });
    await expectRest(page, 'running', null);

    ev('hibernate', 'done', {
      kernel_state: 'hibernated',
      commit: 'cd'.repeat(32)
    });
    await expectRest(page, 'hibernated', 'Hibernated');
    await expect(indicators(page).toolbar.locator('button')).toHaveAttribute(
      'title',
      /saved in snapshot cdcdcdcd.*Run a cell, or click here, to wake it/
    );
    await shotRest(page, testInfo, 'rest-hibernated');

    // A click wakes: the server answers once the kernel is awake; its events
    // say how far it is meanwhile.
    let answer: (() => Promise<void>) | null = null;
    rest.onWake = (route, body) => {
      answer = () =>
        route.fulfill({
          json: { kernel_id: body.kernel_id, state: 'running' }
        });
    };
    await indicators(page).toolbar.locator('button').click();
    await expect
      .poll(() => rest.bodies.wake)
      .toEqual([{ kernel_id: kernelId }]);
    await expectRest(page, 'waking', 'Waking…');
    ev('wake', 'queued', { kernel_state: 'waking', op_id: 'wake-2' });
    backend.emit({
      op: 'restore',
      op_id: 'restore-2',
      kernel_id: kernelId,
      path: '',
      phase: 'restore',
      percent: 40
    });
    await expectRest(page, 'waking', 'Waking… 40%');
    await expect(indicators(page).toolbar).toHaveCSS(
      '--jp-infinijup-rest-progress',
      '40%'
    );
    await shotRest(page, testInfo, 'rest-waking');
    // Not clickable while waking: no second request.
    await indicators(page).toolbar.locator('button').click({ force: true });
    ev('wake', 'done', { kernel_state: 'running', op_id: 'wake-2' });
    await expectRest(page, 'running', null);
    await answer!();
    expect(rest.bodies.wake).toHaveLength(1);
  });

  test('a notebook opened on a hibernated kernel shows it (GET /status)', async ({
    page
  }) => {
    rest.state = 'hibernated';
    await createNotebook(page, 'asleep.ipynb');
    await currentKernelId(page);
    await openHistory(page);
    await expectRest(page, 'hibernated', 'Hibernated');
    // A failed wake: the reason in a notification; still hibernated.
    rest.onWake = route =>
      route.fulfill({
        status: 500,
        json: {
          message: 'the snapshot could not be restored: no space left',
          reason: 'restore_failed'
        }
      });
    await indicators(page).statusbar.locator('button').click();
    await expect(
      toasts(page).filter({
        hasText:
          'Wake of asleep.ipynb failed: the snapshot could not be restored: no space left (restore_failed)'
      })
    ).toBeVisible();
    await expectRest(page, 'hibernated', 'Hibernated');
  });

  test('Hibernate Kernel: Kernel menu and palette; 409 busy is a notification with the server message', async ({
    page
  }) => {
    await createNotebook(page, 'cmd.ipynb');
    const kernelId = await currentKernelId(page);
    await openHistory(page);

    await page.keyboard.press('Control+Shift+C');
    await page
      .locator('#command-palette .lm-CommandPalette-input')
      .fill('hibernate kernel');
    await expect(
      page.locator('#command-palette .lm-CommandPalette-item', {
        hasText: 'Hibernate Kernel'
      })
    ).toBeVisible();
    await page.keyboard.press('Escape');

    // Refused: a cell keeps running.
    rest.onHibernate = route =>
      route.fulfill({
        status: 409,
        json: {
          message: 'the kernel stayed busy for 30 s: a cell is running',
          reason: 'kernel_busy'
        }
      });
    await page.menu.clickMenuItem('Kernel>Hibernate Kernel');
    // said whole within the 140 characters a toast shows (the server's own words behind
    // Details)
    await expect(
      toasts(page).filter({
        hasText:
          'Hibernate of cmd.ipynb failed: the kernel is running a cell: interrupt it or retry when it ends (kernel_busy)'
      })
    ).toBeVisible();
    await expectRest(page, 'running', null);

    // Accepted.
    let answer: (() => Promise<void>) | null = null;
    rest.onHibernate = (route, body) => {
      answer = () =>
        route.fulfill({
          json: {
            kernel_id: body.kernel_id,
            state: 'hibernated',
            commit: 'cd'.repeat(32)
          }
        });
    };
    await page.menu.clickMenuItem('Kernel>Hibernate Kernel');
    await expectRest(page, 'hibernating', 'Hibernating…');
    rest.state = 'hibernated';
    await answer!();
    await expectRest(page, 'hibernated', 'Hibernated');
    expect(rest.bodies.hibernate).toEqual([
      { kernel_id: kernelId },
      { kernel_id: kernelId }
    ]);
    // Hibernated: the command is disabled until the kernel wakes.
    await page.menu.open('Kernel');
    await expect(
      page.locator('.lm-Menu-item', { hasText: 'Hibernate Kernel' }).last()
    ).toHaveClass(/lm-mod-disabled/);
    await page.keyboard.press('Escape');
  });
});
