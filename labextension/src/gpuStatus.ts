/**
 * Who holds GPU memory on this server (issue 27), in the status bar:
 * "GPU 29.8 GiB · 1 released · 1 hibernated", with each kernel's notebook,
 * place (on the GPU, in host memory, in the store) and size in the tooltip.
 * Shown only while some kernel has GPU memory anywhere; read from
 * GET /infinijup/status every few seconds on a server with GPUs (once on one
 * without).
 */

import { ServerConnection } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';
import { ISignal, Signal } from '@lumino/signaling';

import { formatBytes } from './format';
import { requestAPI } from './request';

/** One kernel of GET /infinijup/status (no kernel_id). */
export interface IKernelGpu {
  kernel_id: string;
  path: string;
  state: string;
  gpu: { where: 'gpu' | 'host' | 'store'; bytes: number } | null;
}

const PLACES = {
  gpu: 'on the GPU',
  host: 'released (host memory)',
  store: 'hibernated (store)'
};

/** The status bar's text and tooltip; null when no kernel has GPU memory. */
export function summarizeGpu(
  kernels: readonly IKernelGpu[]
): { text: string; title: string } | null {
  const holding = kernels.filter(k => k.gpu && k.gpu.bytes > 0);
  if (!holding.length) {
    return null;
  }
  const onGpu = holding
    .filter(k => k.gpu!.where === 'gpu')
    .reduce((n, k) => n + k.gpu!.bytes, 0);
  const count = (where: string) =>
    holding.filter(k => k.gpu!.where === where).length;
  const parts = [`GPU ${formatBytes(onGpu)}`];
  if (count('host')) {
    parts.push(`${count('host')} released`);
  }
  if (count('store')) {
    parts.push(`${count('store')} hibernated`);
  }
  const title = holding
    .map(
      k =>
        `${k.path.split('/').pop() || k.kernel_id}: ${formatBytes(k.gpu!.bytes)} ${PLACES[k.gpu!.where]}`
    )
    .join('\n');
  return { text: parts.join(' · '), title };
}

/** The status bar item. */
export class GpuIndicator extends Widget {
  constructor(
    private readonly _settings: ServerConnection.ISettings,
    private readonly _intervalMs = 5000
  ) {
    super();
    this.addClass('jp-Infinijup-gpu-statusbar');
    void this.refresh().then(hasGpus => {
      if (hasGpus && !this.isDisposed) {
        this._timer = setInterval(() => void this.refresh(), this._intervalMs);
      }
    });
  }

  /** Whether some kernel has GPU memory (the item shows only then). */
  get isActive(): boolean {
    return this._active;
  }

  get activeChanged(): ISignal<this, void> {
    return this._activeChanged;
  }

  /** Read the server's status; true when it has GPUs. */
  async refresh(): Promise<boolean> {
    let summary: { text: string; title: string } | null = null;
    let hasGpus = false;
    try {
      const reply = await requestAPI<{
        kernels?: IKernelGpu[];
        gpus?: unknown[];
      }>('status', { method: 'GET' }, this._settings);
      summary = summarizeGpu(reply.kernels ?? []);
      hasGpus = (reply.gpus ?? []).length > 0;
    } catch {
      summary = null; // an older server, or none: nothing to show
    }
    this.node.textContent = summary?.text ?? '';
    this.node.title = summary?.title ?? '';
    if (!!summary !== this._active) {
      this._active = !!summary;
      this._activeChanged.emit();
    }
    return hasGpus;
  }

  dispose(): void {
    if (this._timer !== null) {
      clearInterval(this._timer);
    }
    super.dispose();
  }

  private _active = false;
  private _activeChanged = new Signal<this, void>(this);
  private _timer: ReturnType<typeof setInterval> | null = null;
}
