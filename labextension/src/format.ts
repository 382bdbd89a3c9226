/** Small formatting helpers (pure). */

import { cellLabel, changedVariables, commitTitle } from './commits';
import type { ICommit, IVariableInfo } from './types';

/** The first 8 hex digits of a commit id. */
export function shortId(id: string | null | undefined): string {
  return id ? id.slice(0, 8) : '';
}

/** 1536 -> "1.5 KiB". */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) {
    return '–';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
  let value = Math.max(0, bytes);
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit++;
  }
  const digits = unit === 0 || value >= 100 ? 0 : value >= 10 ? 1 : 2;
  return `${value.toFixed(digits)} ${units[unit]}`;
}

/** 0.0123 -> "12 ms", 2.5 -> "2.5 s", 75 -> "1 min 15 s". */
export function formatSeconds(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) {
    return '–';
  }
  if (seconds < 1) {
    return `${Math.round(seconds * 1000)} ms`;
  }
  if (seconds < 60) {
    return `${seconds < 10 ? seconds.toFixed(1) : Math.round(seconds)} s`;
  }
  const min = Math.floor(seconds / 60);
  const sec = Math.round(seconds - min * 60);
  return sec ? `${min} min ${sec} s` : `${min} min`;
}

/**
 * A short relative time: "just now", "5 min ago", "3 h ago", "2 d ago", or
 * the date for older times.
 *
 * @param created - seconds since the epoch.
 * @param now - milliseconds since the epoch (defaults to Date.now()).
 */
export function formatAge(created: number, now: number = Date.now()): string {
  if (!created) {
    return '';
  }
  const s = Math.round(now / 1000 - created);
  if (s < 45) {
    return 'just now';
  }
  if (s < 3600) {
    return `${Math.max(1, Math.round(s / 60))} min ago`;
  }
  if (s < 86400) {
    return `${Math.round(s / 3600)} h ago`;
  }
  if (s < 86400 * 14) {
    return `${Math.round(s / 86400)} d ago`;
  }
  return new Date(created * 1000).toLocaleDateString();
}

/**
 * The age for narrow rows: "now", "5m", "3h", "2d", or the short date.
 *
 * @param created - seconds since the epoch.
 * @param now - milliseconds since the epoch (defaults to Date.now()).
 */
export function formatAgeShort(
  created: number,
  now: number = Date.now()
): string {
  if (!created) {
    return '';
  }
  const s = Math.round(now / 1000 - created);
  if (s < 45) {
    return 'now';
  }
  if (s < 3600) {
    return `${Math.max(1, Math.round(s / 60))}m`;
  }
  if (s < 86400) {
    return `${Math.round(s / 3600)}h`;
  }
  if (s < 86400 * 14) {
    return `${Math.round(s / 86400)}d`;
  }
  return new Date(created * 1000).toLocaleDateString(undefined, {
    month: 'short',
    day: 'numeric'
  });
}

/** The absolute local time of a commit. */
export function formatDate(created: number): string {
  return created ? new Date(created * 1000).toLocaleString() : '';
}

/** True when the commit holds GPU state (`metadata.gpu` is a dict). */
export function hasGpu(commit: ICommit): boolean {
  const gpu = commit.metadata?.gpu;
  return !!gpu && typeof gpu === 'object';
}

/** A multi-line summary of a commit, for tooltips. */
export function commitTooltip(commit: ICommit): string {
  const lines = [commitTitle(commit)];
  const cell = cellLabel(commit);
  if (commit.message && cell) {
    lines.push(`cell ${cell}`);
  }
  const changed = changedVariables(commit);
  if (changed && changed.length) {
    const names = changed.slice(0, 8).map(v => v.name);
    lines.push(
      `changed: ${names.join(', ')}${changed.length > names.length ? ` and ${changed.length - names.length} more` : ''}`
    );
  }
  lines.push(
    `${commit.id}`,
    `thread ${commit.thread} · ${formatDate(commit.created)}`,
    `image ${formatBytes(commit.stats.image_bytes)} · stored ${formatBytes(
      commit.stats.stored_bytes
    )} · paused ${formatSeconds(commit.stats.pause_s)}`
  );
  if (hasGpu(commit)) {
    lines.push(`GPU state ${formatBytes(commit.stats.gpu_bytes ?? 0)}`);
  }
  return lines.join('\n');
}

/**
 * Valid names of new threads, as the server checks them: letters, digits,
 * ".", "_", "-", up to 64, not starting with a symbol, no "--".
 */
export function isValidThreadName(name: string): boolean {
  return /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/.test(name) && !name.includes('--');
}

/**
 * One variable as Compare shows it: "111 (int, 28 B)" where its value was recorded, else
 * "int, 28 B" (with the shape of arrays and containers).
 */
export function describeVariable(v: IVariableInfo): string {
  const kind = `${v.type}${v.shape ? ` ${v.shape}` : ''}, ${formatBytes(v.size)}`;
  return v.value ? `${v.value} (${kind})` : kind;
}
