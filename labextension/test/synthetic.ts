/**
 * Synthetic histories for unit tests and benchmarks (deterministic).
 *
 * Used by the jest tests and by ui-tests/bench (which serves the result in
 * place of GET /infinijup/history).
 */

import type { ICommit, IHistory } from '../src/types';

export interface ISyntheticOptions {
  /** Probability that a step starts a new thread (default 0.04). */
  branchRate?: number;
  /** Most threads alive at once (default 6). */
  maxThreads?: number;
  /** Probability that a commit holds GPU state (default 0.3). */
  gpuRate?: number;
  /** PRNG seed (default 1). */
  seed?: number;
  /** Creation time of the first commit, seconds (default 2025-11-22). */
  start?: number;
}

/** mulberry32 */
function prng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function hexId(rand: () => number): string {
  let s = '';
  for (let i = 0; i < 8; i++) {
    s += Math.floor(rand() * 0x100000000)
      .toString(16)
      .padStart(8, '0');
  }
  return s;
}

/**
 * A history of `n` commits on a main thread with branches, newest first,
 * like GET /infinijup/history returns it.
 */
export function syntheticHistory(
  n: number,
  options: ISyntheticOptions = {}
): IHistory {
  const rand = prng(options.seed ?? 1);
  const branchRate = options.branchRate ?? 0.04;
  const maxThreads = options.maxThreads ?? 6;
  const gpuRate = options.gpuRate ?? 0.3;
  let time = options.start ?? 1763769600;

  const commits: ICommit[] = [];
  const threads: { [name: string]: string } = {};
  const alive: string[] = [];
  let branchNo = 0;

  const make = (thread: string, parent: string | null): ICommit => {
    time += 30 + Math.floor(rand() * 600);
    const gpu = rand() < gpuRate;
    const image = Math.floor((200 + rand() * 4000) * 1024 * 1024);
    const commit: ICommit = {
      id: hexId(rand),
      parents: parent ? [parent] : [],
      thread,
      message: rand() < 0.15 ? '' : `step ${commits.length + 1} on ${thread}`,
      created: time,
      metadata: gpu
        ? { gpu: { devices: 1, driver: '580.65' }, python: '3.11' }
        : { python: '3.11' },
      stats: {
        image_bytes: image,
        stored_bytes: Math.floor(image * (0.05 + rand() * 0.4)),
        pause_s: 0.2 + rand() * 3,
        duration_s: 1 + rand() * 8,
        gpu_bytes: gpu ? Math.floor(rand() * 8 * 1024 ** 3) : 0
      }
    };
    commits.push(commit);
    threads[thread] = commit.id;
    return commit;
  };

  if (n > 0) {
    make('main', null);
    alive.push('main');
  }
  while (commits.length < n) {
    if (alive.length < maxThreads && rand() < branchRate) {
      // Branch from a recent commit of any thread.
      const from =
        commits[
          Math.max(
            0,
            commits.length -
              1 -
              Math.floor(rand() * Math.min(40, commits.length))
          )
        ];
      const name = `exp-${++branchNo}`;
      make(name, from.id);
      alive.push(name);
      continue;
    }
    if (alive.length > 1 && rand() < branchRate / 2) {
      // A thread is abandoned (never main).
      alive.splice(1 + Math.floor(rand() * (alive.length - 1)), 1);
      continue;
    }
    // Mostly main, sometimes another live thread.
    const thread =
      rand() < 0.6 ? 'main' : alive[Math.floor(rand() * alive.length)];
    make(thread, threads[thread]);
  }
  const newestFirst = commits.slice().reverse();
  const tip = threads.main ?? null;
  return {
    commits: newestFirst,
    threads,
    head: { thread: 'main', commit: tip }
  };
}

/** A linear history c0 (root) .. c{n-1} (tip), newest first, ids "c<i>". */
export function linearHistory(n: number, thread = 'main'): ICommit[] {
  const out: ICommit[] = [];
  for (let i = 0; i < n; i++) {
    out.push(commit(`c${i}`, i > 0 ? [`c${i - 1}`] : [], thread, i + 1));
  }
  return out.reverse();
}

/** A commit with defaults. */
export function commit(
  id: string,
  parents: string[],
  thread = 'main',
  created = 0,
  message = ''
): ICommit {
  return {
    id,
    parents,
    thread,
    message: message || `commit ${id}`,
    created,
    metadata: {},
    stats: {
      image_bytes: 0,
      stored_bytes: 0,
      pause_s: 0,
      duration_s: 0,
      gpu_bytes: 0
    }
  };
}
