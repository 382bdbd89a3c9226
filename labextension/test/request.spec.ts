import { ServerConnection } from '@jupyterlab/services';

import {
  InfinijupClient,
  InfinijupRequestError,
  normalizeHistory,
  requestAPI
} from '../src/request';

type Handler = (request: Request) => Response | Promise<Response>;

function settings(handler: Handler): ServerConnection.ISettings {
  return ServerConnection.makeSettings({
    baseUrl: 'http://localhost:8888/lab-base/',
    wsUrl: 'ws://localhost:8888/lab-base/',
    token: 'secret',
    fetch: ((input: RequestInfo) =>
      Promise.resolve(handler(input as Request))) as any
  });
}

function json(status: number, body: unknown): Response {
  return new Response(JSON.stringify(body), {
    status,
    headers: { 'Content-Type': 'application/json' }
  });
}

async function failure(
  promise: Promise<unknown>
): Promise<InfinijupRequestError> {
  try {
    await promise;
  } catch (error) {
    expect(error).toBeInstanceOf(InfinijupRequestError);
    return error as InfinijupRequestError;
  }
  throw new Error('expected a failure');
}

describe('requestAPI', () => {
  it('calls the API under the base url and decodes JSON', async () => {
    const seen: Request[] = [];
    const data = await requestAPI<{ ok: number }>(
      'status?kernel_id=k1',
      {},
      settings(req => {
        seen.push(req);
        return json(200, { ok: 1 });
      })
    );
    expect(data).toEqual({ ok: 1 });
    // ServerConnection adds a cache buster (cache: 'no-store').
    expect(seen[0].url.replace(/&\d+$/, '')).toBe(
      'http://localhost:8888/lab-base/infinijup/status?kernel_id=k1'
    );
    expect(seen[0].headers.get('Authorization')).toBe('token secret');
  });

  it('turns the server error body into message and reason', async () => {
    const error = await failure(
      requestAPI(
        'restore',
        { method: 'POST', body: '{}' },
        settings(() =>
          json(404, {
            message: "No commit 'deadbeef' in this history",
            reason: 'not_found'
          })
        )
      )
    );
    expect(error.status).toBe(404);
    expect(error.reason).toBe('not_found');
    expect(error.message).toBe("No commit 'deadbeef' in this history");
    expect(error.describe()).toBe(
      "No commit 'deadbeef' in this history (not_found)"
    );
  });

  it('defaults the reason to the status', async () => {
    const error = await failure(
      requestAPI(
        'snapshot',
        {},
        settings(() => json(409, { message: 'busy' }))
      )
    );
    expect(error.reason).toBe('http_409');
    expect(error.message).toBe('busy');
  });

  it('explains a missing server extension', async () => {
    const error = await failure(
      requestAPI(
        'history',
        {},
        settings(
          () => new Response('<html>404: Not Found</html>', { status: 404 })
        )
      )
    );
    expect(error.reason).toBe('extension_missing');
    expect(error.message).toMatch(/server extension is not available/);
  });

  it('reports other non-JSON failures by status', async () => {
    const error = await failure(
      requestAPI(
        'history',
        {},
        settings(
          () =>
            new Response('gateway', { status: 502, statusText: 'Bad Gateway' })
        )
      )
    );
    expect(error.reason).toBe('http_502');
    expect(error.status).toBe(502);
  });

  it('reports network failures', async () => {
    const error = await failure(
      requestAPI(
        'history',
        {},
        settings(() => {
          throw new TypeError('Failed to fetch');
        })
      )
    );
    expect(error.reason).toBe('network_error');
    expect(error.message).toMatch(/Failed to fetch/);
  });

  it('rejects a success reply that is not JSON', async () => {
    const error = await failure(
      requestAPI(
        'history',
        {},
        settings(() => new Response('<html/>', { status: 200 }))
      )
    );
    expect(error.reason).toBe('bad_response');
  });

  it('returns undefined for an empty body', async () => {
    expect(
      await requestAPI(
        'x',
        {},
        settings(() => new Response('', { status: 200 }))
      )
    ).toBeUndefined();
  });
});

describe('InfinijupClient', () => {
  it('posts snapshots and restores with compact JSON bodies', async () => {
    const bodies: any[] = [];
    const urls: string[] = [];
    const client = new InfinijupClient(
      settings(async req => {
        urls.push(`${req.method} ${new URL(req.url).pathname}`);
        bodies.push(await req.json());
        return json(201, {
          commit: 'c',
          thread: 'main',
          parents: [],
          stats: {}
        });
      })
    );
    await client.snapshot({ kernel_id: 'k1', message: '' });
    await client.restore({
      kernel_id: 'k1',
      commit: 'abcd1234',
      branch: 'exp'
    });
    expect(urls).toEqual([
      'POST /lab-base/infinijup/snapshot',
      'POST /lab-base/infinijup/restore'
    ]);
    expect(bodies).toEqual([
      { kernel_id: 'k1' },
      { kernel_id: 'k1', commit: 'abcd1234', branch: 'exp' }
    ]);
  });

  it('posts resumes and branches', async () => {
    const calls: [string, any][] = [];
    const client = new InfinijupClient(
      settings(async req => {
        calls.push([new URL(req.url).pathname, await req.json()]);
        return json(200, { kernel_id: 'k2', path: 'a-12345678.ipynb' });
      })
    );
    const result = await client.resume({
      path: 'a.ipynb',
      commit: 'abcd1234',
      new_notebook: true
    });
    expect(result.path).toBe('a-12345678.ipynb');
    await client.resume({ path: 'a.ipynb', commit: 'abcd1234' });
    await client.branch({ kernel_id: 'k1', name: 'exp' });
    expect(calls).toEqual([
      [
        '/lab-base/infinijup/resume',
        { path: 'a.ipynb', commit: 'abcd1234', new_notebook: true }
      ],
      ['/lab-base/infinijup/resume', { path: 'a.ipynb', commit: 'abcd1234' }],
      ['/lab-base/infinijup/branch', { kernel_id: 'k1', name: 'exp' }]
    ]);
  });

  it('queries history by kernel or path', async () => {
    const urls: string[] = [];
    const client = new InfinijupClient(
      settings(req => {
        urls.push(
          req.url
            .replace('http://localhost:8888/lab-base/infinijup/', '')
            .replace(/&\d+$/, '')
        );
        return json(200, { commits: [], threads: {}, head: null });
      })
    );
    await client.history({ kernel_id: 'k1' });
    await client.history({ path: 'dir/a b.ipynb' });
    await client.status('k1');
    expect(urls).toEqual([
      'history?kernel_id=k1',
      'history?path=dir%2Fa%20b.ipynb',
      'status?kernel_id=k1'
    ]);
  });
});

describe('normalizeHistory', () => {
  it('fills missing fields', () => {
    const h = normalizeHistory({
      commits: [{ id: 'a', parents: ['b', 3] }, { nope: 1 }],
      threads: { main: 'a', bad: 4 }
    });
    expect(h.commits).toHaveLength(1);
    expect(h.commits[0]).toEqual({
      id: 'a',
      parents: ['b'],
      thread: '',
      message: '',
      created: 0,
      metadata: {},
      stats: {
        image_bytes: 0,
        stored_bytes: 0,
        pause_s: 0,
        duration_s: 0,
        gpu_bytes: 0
      }
    });
    expect(h.threads).toEqual({ main: 'a' });
    expect(h.head).toBeNull();
  });

  it('keeps where the next snapshot goes and whether commits resume here', () => {
    const h = normalizeHistory({
      commits: [
        { id: 'a', resumable: false, resumable_reason: 'other GPUs' },
        { id: 'b', resumable: true, resumable_reason: null },
        { id: 'c', resumable: 'maybe' }
      ],
      threads: { main: 'b' },
      head: { thread: null, commit: 'a', next_thread: 'main-1' }
    });
    expect(h.head).toEqual({
      thread: null,
      commit: 'a',
      next_thread: 'main-1'
    });
    expect(h.commits[0].resumable).toBe(false);
    expect(h.commits[0].resumable_reason).toBe('other GPUs');
    expect(h.commits[1].resumable).toBe(true);
    expect('resumable' in h.commits[2]).toBe(false);
    // Older servers: no next_thread, an empty thread reads as none.
    expect(
      normalizeHistory({ commits: [], head: { thread: '', commit: null } }).head
    ).toEqual({ thread: null, commit: null, next_thread: null });
  });

  it('rejects replies without commits', () => {
    expect(() => normalizeHistory({})).toThrow(InfinijupRequestError);
  });
});
