/**
 * Helpers of the Infinijup UI tests: a mocked Infinijup API (REST routes and
 * the event socket) for tests that need only JupyterLab, and small page
 * utilities shared with the backend tests.
 */

import { createHash } from 'crypto';
import * as fs from 'fs';
import * as path from 'path';

import { expect } from '@jupyterlab/galata';
import type { IJupyterLabPageFixture } from '@jupyterlab/galata';
import type {
  Locator,
  Page,
  Route,
  TestInfo,
  WebSocketRoute
} from '@playwright/test';

export const EVENT_SCHEMA_ID = 'https://events.infinijup.dev/operation';

export interface ICommitJSON {
  id: string;
  parents: string[];
  thread: string;
  message: string;
  created: number;
  metadata: { [key: string]: any };
  stats: { [key: string]: number };
  resumable?: boolean;
  resumable_reason?: string | null;
}

export interface IHistoryJSON {
  commits: ICommitJSON[];
  threads: { [name: string]: string };
  head: {
    thread: string | null;
    commit: string | null;
    next_thread?: string | null;
  } | null;
}

/** A mocked Infinijup server: edit its fields, the routes read them. */
export class MockBackend {
  history: IHistoryJSON = { commits: [], threads: {}, head: null };
  managed = true;
  /** Requests seen, as "METHOD /path?query". */
  requests: string[] = [];
  /** Bodies of POST requests, by endpoint. */
  bodies: { [endpoint: string]: any[] } = {
    snapshot: [],
    restore: [],
    branch: [],
    resume: []
  };
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

  onBranch: (route: Route, body: any) => Promise<void> | void = (route, body) =>
    route.fulfill({
      json: {
        kernel_id: body.kernel_id,
        thread: body.name,
        commit: this.history.head?.commit ?? null
      }
    });
  /**
   * Resume: like the server, start a kernel for the notebook (a real
   * python3 kernel through the sessions API) at its path, or at a copy of the
   * notebook "<stem>-<short id>.ipynb" for `new_notebook`.
   */
  onResume: (route: Route, body: any) => Promise<void> | void = async (
    route,
    body
  ) => {
    const request = route.request();
    const origin = new URL(request.url()).origin;
    const api = this._page!.request;
    let target: string = body.path;
    if (body.new_notebook) {
      target = target.replace(/\.ipynb$/, `-${body.commit.slice(0, 8)}.ipynb`);
      // The notebook may not be on disk yet (a new one is saved just after it
      // opens): wait for it, as the server would find it.
      let source = await api.get(`${origin}/api/contents/${body.path}`);
      for (let i = 0; i < 100 && !source.ok(); i++) {
        await new Promise(resolve => setTimeout(resolve, 100));
        source = await api.get(`${origin}/api/contents/${body.path}`);
      }
      if (!source.ok()) {
        throw new Error(
          `${body.path} is not on the server (${source.status()})`
        );
      }
      const model = await source.json();
      await api.put(`${origin}/api/contents/${target}`, {
        data: { type: 'notebook', format: 'json', content: model.content }
      });
    }
    const session = await (
      await api.post(`${origin}/api/sessions`, {
        data: {
          path: target,
          type: 'notebook',
          name: target.split('/').pop(),
          kernel: { name: 'python3' }
        }
      })
    ).json();
    await route.fulfill({
      json: {
        kernel_id: session.kernel.id,
        session_id: session.id,
        path: target,
        commit: body.commit,
        thread: 'main',
        duration_s: 1.25
      }
    });
  };

  private _sockets: WebSocketRoute[] = [];
  private _page: Page | null = null;

  /**
   * Install the routes. Call before the page loads JupyterLab (the event
   * socket is opened at startup): use `test.use({ autoGoto: false })`.
   */
  async install(page: Page): Promise<void> {
    this._page = page;
    await page.route(
      /\/infinijup\/(status|history|snapshot|restore|branch|resume)(\?.*)?$/,
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

  /**
   * Answer a mocked request. A handler that throws answers 500 with what went
   * wrong: the request must never go on to the real server, whose answer
   * (say, an unknown commit) would hide the mock's failure.
   */
  private async _handle(route: Route): Promise<void> {
    try {
      await this._answer(route);
    } catch (error) {
      await route
        .fulfill({
          status: 500,
          json: { message: `the test's mock failed: ${error}`, reason: 'mock' }
        })
        .catch(() => undefined); // answered before it failed
    }
  }

  private async _answer(route: Route): Promise<void> {
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
      case 'branch': {
        const body = request.postDataJSON();
        this.bodies.branch.push(body);
        await this.onBranch(route, body);
        return;
      }
      case 'resume': {
        const body = request.postDataJSON();
        this.bodies.resume.push(body);
        await this.onResume(route, body);
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

/**
 * Dismiss every notification and wait until no toast is on screen.
 *
 * JupyterLab's toasts stack up from the bottom right, over the right sidebar's
 * lower part, where the history panel's rows are. A click on a row under a toast
 * waits until the toast is gone (Playwright: "intercepts pointer events"), and
 * a toast that is hovered, or that an operation's notification keeps open, may
 * not go: call this once a test has checked what its toasts said.
 */
export async function dismissToasts(page: Page): Promise<void> {
  // Again until none is left: one may come while the others go.
  await expect
    .poll(async () => {
      await page.evaluate(async () => {
        const w = window as any;
        for (const n of await w.galata.getNotifications()) {
          await w.jupyterapp.commands.execute('apputils:dismiss-notification', {
            id: n.id
          });
        }
      });
      return toasts(page).count();
    })
    .toBe(0);
}

/** Per page, the notifications `notified` has already answered with. */
const answered = new WeakMap<object, Set<string>>();

/**
 * Wait for a notification whose message contains `text`; return its message.
 *
 * For outcomes shown in a toast that closes itself (a success closes after
 * 5 s): the notification stays in JupyterLab's list after its toast is gone,
 * so a machine busy enough to look at the page only now and then cannot miss
 * it. Each notification answers one call, so a second operation with the same
 * message waits for its own. A failure lists the notifications there were (an
 * error says why).
 */
export async function notified(
  page: IJupyterLabPageFixture,
  text: string,
  timeout = 90_000
): Promise<string> {
  const used = answered.get(page) ?? new Set<string>();
  answered.set(page, used);
  let seen: string[] = [];
  let found: { id: string; message: string } | undefined;
  try {
    await expect
      .poll(
        async () => {
          const all = await page.notifications;
          seen = all.map(n => `${n.type}: ${n.message}`);
          found = all.find(n => !used.has(n.id) && n.message.includes(text));
          return found !== undefined;
        },
        { timeout }
      )
      .toBe(true);
  } catch {
    throw new Error(
      `No notification with "${text}" within ${timeout} ms. ` +
        `The notifications: ${seen.length ? seen.join(' | ') : 'none'}`
    );
  }
  used.add(found!.id);
  return found!.message;
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
  gpu = false,
  metadata: { [key: string]: any } = {}
): ICommitJSON {
  return {
    id,
    parents,
    thread,
    message,
    created,
    metadata: { ...(gpu ? { gpu: { devices: 1 } } : {}), ...metadata },
    stats: {
      image_bytes: 512 * 1024 * 1024,
      stored_bytes: 64 * 1024 * 1024,
      pause_s: 0.8,
      duration_s: 2.1,
      gpu_bytes: gpu ? 2 * 1024 ** 3 : 0
    }
  };
}

/** `metadata.cell` and `metadata.variables` as the kernel records them. */
export function described(
  count: number,
  source: string,
  variables: [string, string, number, string | null, string, boolean][]
): { [key: string]: any } {
  return {
    cell: { execution_count: count, source },
    variables: {
      items: variables.map(([name, type, size, shape, fp, changed]) => ({
        name,
        type,
        size,
        shape,
        fp,
        changed
      })),
      truncated: false
    }
  };
}

/** Whether two boxes overlap. */
export function overlaps(
  a: { x: number; y: number; width: number; height: number },
  b: { x: number; y: number; width: number; height: number }
): boolean {
  return (
    a.x < b.x + b.width &&
    b.x < a.x + a.width &&
    a.y < b.y + b.height &&
    b.y < a.y + a.height
  );
}

/** A 64-hex id from a short tag (its SHA-256). */
export function hex(tag: string): string {
  return createHash('sha256').update(tag).digest('hex');
}

const MiB = 1024 * 1024;

/**
 * A small notebook history with three threads, as a user's would look: most
 * commits carry the kernel's description (last cell, variables), a few have
 * messages, one (b2) is an older snapshot without a description.
 */
export function demoHistory(now: number): IHistoryJSON {
  const t = (min: number) => now - min * 60;
  const df: V = ['df', 'DataFrame', 412 * MiB, '(1200000, 14)', 'df1', false];
  const X: V = ['X', 'ndarray', 586 * MiB, '(1200000, 64)', 'x1', false];
  const y: V = ['y', 'ndarray', 9.2 * MiB, '(1200000,)', 'y1', false];
  const tok: V = ['tokenizer', 'Tokenizer', 31 * MiB, null, 't1', false];
  const base = [df, X, y, tok];
  const ch = (v: V, fp?: string): V => [
    v[0],
    v[1],
    v[2],
    v[3],
    fp ?? v[4],
    true
  ];
  const model = (fp: string, changed = true): V => [
    'model',
    'Net',
    1.1 * 1024 * MiB,
    null,
    fp,
    changed
  ];
  const opt = (fp: string, changed = true): V => [
    'opt',
    'AdamW',
    2.2 * 1024 * MiB,
    null,
    fp,
    changed
  ];
  const c = [
    commit(
      hex('m1'),
      [],
      'main',
      t(300),
      'load data (12 GB parquet)',
      false,
      described(3, 'df = pd.read_parquet("events.parquet")', [ch(df)])
    ),
    commit(
      hex('m2'),
      [hex('m1')],
      'main',
      t(240),
      '',
      true,
      described(5, 'X, y = featurize(df, tokenizer)', [
        df,
        ch(X),
        ch(y),
        ch(tok)
      ])
    ),
    commit(
      hex('m3'),
      [hex('m2')],
      'main',
      t(200),
      'model on GPU, epoch 0',
      true,
      described(8, 'model = Net(d=64).cuda(); opt = AdamW(model)', [
        ...base,
        model('n0'),
        opt('o0')
      ])
    ),
    commit(
      hex('a1'),
      [hex('m3')],
      'lr-3e-4',
      t(150),
      '',
      true,
      described(11, 'train(model, opt, lr=3e-4, epochs=1)', [
        ...base,
        model('a-n1'),
        opt('a-o1'),
        ['history', 'list', 4096, 'len 1', 'h1', true]
      ])
    ),
    commit(
      hex('m4'),
      [hex('m3')],
      'main',
      t(120),
      '',
      true,
      described(10, 'losses = train(model, opt, epochs=1)', [
        ...base,
        model('n1'),
        opt('o1'),
        ['losses', 'list', 8192, 'len 938', 'l1', true]
      ])
    ),
    commit(
      hex('a2'),
      [hex('a1')],
      'lr-3e-4',
      t(90),
      '',
      true,
      described(12, 'train(model, opt, lr=3e-4, epochs=1)', [
        ...base,
        model('a-n2'),
        opt('a-o2'),
        ['history', 'list', 8192, 'len 2', 'h2', true]
      ])
    ),
    commit(
      hex('b1'),
      [hex('m2')],
      'cpu-baseline',
      t(80),
      'sklearn baseline',
      false,
      described(9, 'clf = LogisticRegression().fit(X, y)', [
        ...base,
        ['clf', 'LogisticRegression', 2 * MiB, null, 'c1', true]
      ])
    ),
    commit(
      hex('m5'),
      [hex('m4')],
      'main',
      t(45),
      '',
      true,
      described(13, 'acc = evaluate(model, X_val, y_val)', [
        ...base,
        model('n1', false),
        opt('o1', false),
        ['losses', 'list', 8192, 'len 938', 'l1', false],
        ['acc', 'float', 24, null, '0.871', true]
      ])
    ),
    commit(hex('b2'), [hex('b1')], 'cpu-baseline', t(30), ''),
    commit(
      hex('m6'),
      [hex('m5')],
      'main',
      t(4),
      'before plotting',
      true,
      described(15, 'fig, ax = plt.subplots(figsize=(8, 4))', [
        ...base,
        model('n1', false),
        opt('o1', false),
        ['losses', 'list', 8192, 'len 938', 'l1', false],
        ['acc', 'float', 24, null, '0.871', false],
        ['fig', 'Figure', 96 * 1024, null, 'f1', true],
        ['ax', 'Axes', 48 * 1024, null, 'ax1', true]
      ])
    )
  ];
  return {
    commits: c.reverse(),
    threads: {
      main: hex('m6'),
      'lr-3e-4': hex('a2'),
      'cpu-baseline': hex('b2')
    },
    head: { thread: 'main', commit: hex('m6'), next_thread: 'main' }
  };
}

type V = [string, string, number, string | null, string, boolean];

/**
 * Take a screenshot into the test's output (attached to the report); with
 * INFINIJUP_DOCS_SCREENSHOT=1 also into docs/images/<name>.png.
 */
export async function screenshot(
  target: Locator | Page,
  testInfo: TestInfo,
  name: string,
  options: {
    clip?: { x: number; y: number; width: number; height: number };
    /** Copy to docs/images with INFINIJUP_DOCS_SCREENSHOT (default true). */
    docs?: boolean;
  } = {}
): Promise<void> {
  const { docs: toDocs = true, ...shot } = options;
  const file = testInfo.outputPath(`${name}.png`);
  await target.screenshot({ path: file, ...shot });
  await testInfo.attach(name, { path: file, contentType: 'image/png' });
  if (toDocs && process.env.INFINIJUP_DOCS_SCREENSHOT) {
    const docs = path.resolve(__dirname, '../../docs/images', `${name}.png`);
    fs.mkdirSync(path.dirname(docs), { recursive: true });
    fs.copyFileSync(file, docs);
  }
}

/**
 * galata's `createNew`, then wait until the page's notebook has its name.
 * `createNew` makes an Untitled notebook and renames it; on a busy machine the
 * page's document may still be "Untitled.ipynb" when it returns (the file on
 * the server already renamed), and a request sent then (a resume, a snapshot)
 * names the old file.
 */
export async function createNotebook(
  page: IJupyterLabPageFixture,
  name: string,
  options: { kernel?: string | null } = { kernel: 'python3' }
): Promise<void> {
  await page.notebook.createNew(name, options);
  await page.waitForFunction(
    (wanted: string) => {
      const path: string =
        (window as any).jupyterapp?.shell?.currentWidget?.context?.path ?? '';
      return path === wanted || path.endsWith(`/${wanted}`);
    },
    name,
    { timeout: 60000 }
  );
  // The tab carries its name before the file is on disk (the save that gives it the name may
  // still be under way): what reads the notebook through the contents API (the mock's "Open
  // in new notebook" copy) waits for the file, not the tab. Galata may work in a directory of
  // the test's own: the tab's path says where.
  const where: string = await page.evaluate(
    () => (window as any).jupyterapp.shell.currentWidget.context.path
  );
  await expect
    .poll(
      async () =>
        (
          await page.request.get(
            `/api/contents/${where.split('/').map(encodeURIComponent).join('/')}?content=0`
          )
        ).status(),
      { timeout: 60000 }
    )
    .toBe(200);
}
