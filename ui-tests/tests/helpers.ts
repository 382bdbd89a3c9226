/**
 * Helpers of the Infinijup UI tests: a mocked Infinijup API (REST routes and
 * the event socket) for tests that need only JupyterLab, and small page
 * utilities shared with the backend tests.
 */

import { createHash } from 'crypto';

import type { IJupyterLabPageFixture } from '@jupyterlab/galata';
import type { Page, Route, WebSocketRoute } from '@playwright/test';

export const EVENT_SCHEMA_ID = 'https://events.infinijup.dev/operation';

export interface ICommitJSON {
  id: string;
  parents: string[];
  thread: string;
  message: string;
  created: number;
  metadata: { [key: string]: any };
  stats: { [key: string]: number };
}

export interface IHistoryJSON {
  commits: ICommitJSON[];
  threads: { [name: string]: string };
  head: { thread: string; commit: string | null } | null;
}

/** A mocked Infinijup server: edit its fields, the routes read them. */
export class MockBackend {
  history: IHistoryJSON = { commits: [], threads: {}, head: null };
  managed = true;
  /** Requests seen, as "METHOD /path?query". */
  requests: string[] = [];
  /** Bodies of POST requests, by endpoint. */
  bodies: { [endpoint: string]: any[] } = { snapshot: [], restore: [] };
  /** Handlers for POSTs; default replies succeed at once. */
  onSnapshot: (route: Route, body: any) => Promise<void> | void = route =>
    route.fulfill({
      status: 201,
      json: {
        commit: 'ab'.repeat(32),
        thread: 'main',
        parents: [],
        stats: {
          image_bytes: 1,
          stored_bytes: 1,
          pause_s: 0.1,
          duration_s: 0.2
        }
      }
    });
  onRestore: (route: Route, body: any) => Promise<void> | void = (
    route,
    body
  ) =>
    route.fulfill({
      status: 200,
      json: {
        kernel_id: body.kernel_id,
        commit: body.commit,
        thread: body.branch ?? 'main',
        duration_s: 0.5
      }
    });

  private _sockets: WebSocketRoute[] = [];

  /**
   * Install the routes. Call before the page loads JupyterLab (the event
   * socket is opened at startup): use `test.use({ autoGoto: false })`.
   */
  async install(page: Page): Promise<void> {
    await page.route(
      /\/infinijup\/(status|history|snapshot|restore)(\?.*)?$/,
      route => this._handle(route)
    );
    await page.routeWebSocket(/\/api\/events\/subscribe/, ws => {
      this._sockets.push(ws);
      ws.onClose(() => {
        this._sockets = this._sockets.filter(s => s !== ws);
      });
    });
  }

  /** Send an operation event to the page (as the server's event bus would). */
  emit(event: { [key: string]: any }): void {
    const message = JSON.stringify({ schema_id: EVENT_SCHEMA_ID, ...event });
    for (const ws of this._sockets) {
      ws.send(message);
    }
  }

  get socketCount(): number {
    return this._sockets.length;
  }

  private async _handle(route: Route): Promise<void> {
    const request = route.request();
    const url = new URL(request.url());
    const endpoint = url.pathname.split('/').pop()!;
    this.requests.push(`${request.method()} ${url.pathname}${url.search}`);
    switch (endpoint) {
      case 'status':
        await route.fulfill({
          json: {
            kernel_id: url.searchParams.get('kernel_id'),
            managed: this.managed,
            operation: null
          }
        });
        return;
      case 'history':
        await route.fulfill({ json: this.history });
        return;
      case 'snapshot': {
        const body = request.postDataJSON();
        this.bodies.snapshot.push(body);
        await this.onSnapshot(route, body);
        return;
      }
      case 'restore': {
        const body = request.postDataJSON();
        this.bodies.restore.push(body);
        await this.onRestore(route, body);
        return;
      }
    }
    await route.fallback();
  }
}

/** The kernel id of the current notebook. */
export async function currentKernelId(page: Page): Promise<string> {
  return page.evaluate(async () => {
    const app = (window as any).jupyterapp;
    const widget = app.shell.currentWidget;
    await widget.sessionContext.ready;
    return widget.sessionContext.session.kernel.id as string;
  });
}

/** Run a JupyterLab command in the page. */
export async function execute(
  page: Page,
  command: string,
  args: { [key: string]: any } = {}
): Promise<void> {
  await page.evaluate(
    ({ command, args }) => {
      // Not awaited: commands may open dialogs the test answers.
      void (window as any).jupyterapp.commands.execute(command, args);
    },
    { command, args }
  );
}

/** Open the Kernel history panel. */
export async function openHistory(page: Page): Promise<void> {
  await execute(page, 'infinijup:show-history');
  await page.locator('#infinijup-history').waitFor({ state: 'visible' });
}

/** Make the right sidebar wider (nicer screenshots, longer messages). */
export async function widenRightPanel(page: Page, width = 460): Promise<void> {
  const panel = page.locator('#infinijup-history');
  const box = await panel.boundingBox();
  if (!box || box.width >= width) {
    return;
  }
  // The split handle sits just left of the right sidebar's stacked panel.
  await page.mouse.move(box.x - 2, box.y + box.height / 2);
  await page.mouse.down();
  await page.mouse.move(
    box.x - 2 - (width - box.width),
    box.y + box.height / 2,
    {
      steps: 5
    }
  );
  await page.mouse.up();
}

/** The texts of the notification toasts now shown. */
export function toasts(page: Page) {
  return page.locator('.Toastify__toast');
}

/** Wait until the current notebook's kernel is idle. */
export async function waitForKernelIdle(
  page: IJupyterLabPageFixture
): Promise<void> {
  await page.waitForFunction(() => {
    const app = (window as any).jupyterapp;
    const widget = app.shell.currentWidget;
    return widget?.sessionContext?.session?.kernel?.status === 'idle';
  });
}

/** A commit as the server sends it. */
export function commit(
  id: string,
  parents: string[],
  thread: string,
  created: number,
  message = '',
  gpu = false
): ICommitJSON {
  return {
    id,
    parents,
    thread,
    message,
    created,
    metadata: gpu ? { gpu: { devices: 1 } } : {},
    stats: {
      image_bytes: 512 * 1024 * 1024,
      stored_bytes: 64 * 1024 * 1024,
      pause_s: 0.8,
      duration_s: 2.1,
      gpu_bytes: gpu ? 2 * 1024 ** 3 : 0
    }
  };
}

/** A 64-hex id from a short tag (its SHA-256). */
export function hex(tag: string): string {
  return createHash('sha256').update(tag).digest('hex');
}
