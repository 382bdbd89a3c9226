import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { InfinijupRequestError } from './errors';
import type {
  IBranchRequest,
  IBranchResult,
  IDeleteRequest,
  IDeleteResult,
  IHistory,
  IHistoryQuery,
  IInfinijupAPI,
  IKernelStatus,
  IRestoreRequest,
  IRestoreResult,
  IResumeRequest,
  IResumeResult,
  ISnapshotRequest,
  ISnapshotResult,
  ISpaceAPI,
  ISpaceStats
} from './types';

/** The URL namespace of the Infinijup server extension. */
export const API_NAMESPACE = 'infinijup';

export { asRequestError, InfinijupRequestError } from './errors';

/**
 * Call the Infinijup REST API.
 *
 * @param endPoint - path under `<base_url>/infinijup/`, with query string if any.
 * @param init - the fetch options (method, body).
 * @param settings - server settings (defaults to the page's).
 * @returns the decoded JSON body (undefined for an empty body).
 * @throws InfinijupRequestError with the server's message and reason.
 */
export async function requestAPI<T>(
  endPoint = '',
  init: RequestInit = {},
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<T> {
  const url = URLExt.join(settings.baseUrl, API_NAMESPACE, endPoint);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new InfinijupRequestError(
      `Could not reach the Jupyter server: ${(error as Error)?.message ?? error}`,
      'network_error',
      0,
      url
    );
  }

  const text = await response.text().catch(() => '');
  let data: any = undefined;
  let parsed = false;
  if (text.length > 0) {
    try {
      data = JSON.parse(text);
      parsed = true;
    } catch {
      parsed = false;
    }
  }

  if (!response.ok) {
    if (parsed && data && typeof data === 'object') {
      const message =
        typeof data.message === 'string' && data.message
          ? data.message
          : `${response.status} ${response.statusText}`.trim();
      const reason =
        typeof data.reason === 'string' && data.reason
          ? data.reason
          : `http_${response.status}`;
      throw new InfinijupRequestError(message, reason, response.status, url);
    }
    if (response.status === 404) {
      throw new InfinijupRequestError(
        'The Infinijup server extension is not available (404); check ' +
          '`jupyter server extension list`.',
        'extension_missing',
        404,
        url
      );
    }
    throw new InfinijupRequestError(
      `Request failed: ${response.status} ${response.statusText}`.trim(),
      `http_${response.status}`,
      response.status,
      url
    );
  }

  if (text.length > 0 && !parsed) {
    throw new InfinijupRequestError(
      'The server sent a reply that is not JSON.',
      'bad_response',
      response.status,
      url
    );
  }
  return data as T;
}

/** The REST API over `requestAPI`. */
export class InfinijupClient implements IInfinijupAPI, ISpaceAPI {
  constructor(
    readonly serverSettings: ServerConnection.ISettings = ServerConnection.makeSettings()
  ) {}

  snapshot(body: ISnapshotRequest): Promise<ISnapshotResult> {
    return this._post<ISnapshotResult>('snapshot', body);
  }

  restore(body: IRestoreRequest): Promise<IRestoreResult> {
    return this._post<IRestoreResult>('restore', body);
  }

  branch(body: IBranchRequest): Promise<IBranchResult> {
    return this._post<IBranchResult>('branch', body);
  }

  resume(body: IResumeRequest): Promise<IResumeResult> {
    return this._post<IResumeResult>('resume', body);
  }

  async history(query: IHistoryQuery): Promise<IHistory> {
    const data = await requestAPI<IHistory>(
      'history' + URLExt.objectToQueryString(compact(query)),
      { method: 'GET' },
      this.serverSettings
    );
    return normalizeHistory(data);
  }

  status(kernelId: string): Promise<IKernelStatus> {
    return requestAPI<IKernelStatus>(
      'status' + URLExt.objectToQueryString({ kernel_id: kernelId }),
      { method: 'GET' },
      this.serverSettings
    );
  }

  /** Delete a snapshot or a thread of a notebook (409: something needs it). */
  deleteFromHistory(body: IDeleteRequest): Promise<IDeleteResult> {
    return this._post<IDeleteResult>('delete', body);
  }

  /** The store's and the hot tier's sizes. */
  spaceStats(): Promise<ISpaceStats> {
    return requestAPI<ISpaceStats>(
      'stats',
      { method: 'GET' },
      this.serverSettings
    );
  }

  private _post<T>(endPoint: string, body: object): Promise<T> {
    return requestAPI<T>(
      endPoint,
      { method: 'POST', body: JSON.stringify(compact(body)) },
      this.serverSettings
    );
  }
}

/** Drop undefined/null/empty-string members. */
function compact<T extends object>(obj: T): { [key: string]: any } {
  const out: { [key: string]: any } = {};
  for (const [key, value] of Object.entries(obj)) {
    if (value !== undefined && value !== null && value !== '') {
      out[key] = value;
    }
  }
  return out;
}

/**
 * Make a history reply safe to render: default missing fields, so that a
 * partial reply from an older server never breaks the panel.
 */
export function normalizeHistory(data: any): IHistory {
  if (!data || typeof data !== 'object' || !Array.isArray(data.commits)) {
    throw new InfinijupRequestError(
      'The history reply has no commit list.',
      'bad_response',
      200
    );
  }
  const commits = data.commits
    .filter((c: any) => c && typeof c.id === 'string')
    .map((c: any) => ({
      ...(typeof c.resumable === 'boolean'
        ? {
            resumable: c.resumable,
            resumable_reason:
              typeof c.resumable_reason === 'string' ? c.resumable_reason : null
          }
        : {}),
      ...(typeof c.notebook === 'string' ? { notebook: c.notebook } : {}),
      id: c.id,
      parents: Array.isArray(c.parents)
        ? c.parents.filter((p: any) => typeof p === 'string')
        : [],
      thread: typeof c.thread === 'string' ? c.thread : '',
      message: typeof c.message === 'string' ? c.message : '',
      created: typeof c.created === 'number' ? c.created : 0,
      metadata: c.metadata && typeof c.metadata === 'object' ? c.metadata : {},
      stats: {
        image_bytes: num(c.stats?.image_bytes),
        stored_bytes: num(c.stats?.stored_bytes),
        pause_s: num(c.stats?.pause_s),
        duration_s: num(c.stats?.duration_s),
        gpu_bytes: num(c.stats?.gpu_bytes)
      }
    }));
  const threads: { [name: string]: string } = {};
  if (data.threads && typeof data.threads === 'object') {
    for (const [name, tip] of Object.entries(data.threads)) {
      if (typeof tip === 'string') {
        threads[name] = tip;
      }
    }
  }
  const head =
    data.head && typeof data.head === 'object'
      ? {
          thread:
            typeof data.head.thread === 'string' && data.head.thread
              ? data.head.thread
              : null,
          commit:
            typeof data.head.commit === 'string' ? data.head.commit : null,
          next_thread:
            typeof data.head.next_thread === 'string' && data.head.next_thread
              ? data.head.next_thread
              : null
        }
      : null;
  return { commits, threads, head };
}

function num(value: any): number {
  return typeof value === 'number' && Number.isFinite(value) ? value : 0;
}
