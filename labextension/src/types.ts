/**
 * Types of the Infinijup server API (docs/api.md, v1).
 *
 * This module has no runtime dependencies so that the model, the graph layout
 * and their tests can use it without pulling in JupyterLab.
 */

/** The kernelspec name of Infinijup kernels. */
export const KERNELSPEC_NAME = 'infinijup';

/** Schema id of the operation events on the jupyter_server event bus. */
export const EVENT_SCHEMA_ID = 'https://events.infinijup.dev/operation';

/** Statistics of one commit. */
export interface ICommitStats {
  /** Size of the CRIU image before deduplication, in bytes. */
  image_bytes: number;
  /** Bytes newly written to the content-addressed store by this commit. */
  stored_bytes: number;
  /** How long the kernel was paused, in seconds. */
  pause_s: number;
  /** Wall time of the whole operation, in seconds. */
  duration_s: number;
  /** Bytes of GPU memory saved (history only). */
  gpu_bytes?: number;
}

/** One commit of a notebook's history. */
export interface ICommit {
  /** 64 hex digits. */
  id: string;
  /** Parent commit ids (empty for a root commit). */
  parents: string[];
  /** The thread (named branch) the commit was made on. */
  thread: string;
  message: string;
  /** Creation time, seconds since the epoch. */
  created: number;
  /**
   * Free-form metadata; `metadata.gpu` is present when the commit holds GPU
   * state, `metadata.cell` and `metadata.variables` (ICellInfo, IVariables)
   * describe it when the kernel recorded them (older snapshots lack them).
   */
  metadata: { [key: string]: any };
  stats: ICommitStats;
  /** Whether the commit can be resumed on this server (absent: unknown). */
  resumable?: boolean;
  /** Why not, when `resumable` is false. */
  resumable_reason?: string | null;
  /**
   * An automatic snapshot thinned with age: it keeps its place in the history,
   * its images are gone (not restorable).
   */
  thinned?: boolean;
  /**
   * Set on a commit of another notebook (its path): the one this notebook's
   * kernel was resumed from, and its ancestors.
   */
  notebook?: string;
}

/** `metadata.cell`: the last cell the kernel ran before the snapshot. */
export interface ICellInfo {
  execution_count: number | null;
  /** The first line of the cell's source. */
  source: string;
}

/** One user variable in `metadata.variables.items`. */
export interface IVariableInfo {
  name: string;
  /** Its type's name, e.g. "DataFrame". */
  type: string;
  /** Approximate size in bytes. */
  size: number;
  /** e.g. "(1000, 3)", or null. */
  shape: string | null;
  /** A fingerprint that changes when the value changes. */
  fp: string;
  /** Changed since the parent commit (or new). */
  changed: boolean;
  /** A short view of a small value (repr, cut; an array's min, max, mean), where recorded. */
  value?: string;
  /** Too large to look at fully: "unchanged" means no change was seen. */
  partial?: boolean;
}

/** `metadata.variables`. */
export interface IVariables {
  items: IVariableInfo[];
  /** True when the kernel listed only part of its variables. */
  truncated: boolean;
}

/** Where the kernel is now. */
export interface IHead {
  /**
   * The kernel's thread; null after restoring a commit that is no thread's
   * tip (the next snapshot then starts a new thread).
   */
  thread: string | null;
  /** The commit the kernel was last snapshotted or restored at (null if none yet). */
  commit: string | null;
  /** The thread the next snapshot goes to, as the server plans it (newer servers). */
  next_thread?: string | null;
}

/** GET /infinijup/history */
export interface IHistory {
  /** Newest first. */
  commits: ICommit[];
  /** Thread name -> tip commit id. */
  threads: { [name: string]: string };
  head: IHead | null;
}

/** POST /infinijup/snapshot body. */
export interface ISnapshotRequest {
  kernel_id: string;
  message?: string;
  thread?: string;
}

/** POST /infinijup/snapshot reply (201). */
export interface ISnapshotResult {
  commit: string;
  thread: string;
  parents: string[];
  stats: ICommitStats;
}

/** POST /infinijup/restore body. */
export interface IRestoreRequest {
  kernel_id: string;
  /** A full id, a unique prefix of 8+ hex digits, or a thread name. */
  commit: string;
  /** Name of a new thread starting at `commit`. */
  branch?: string;
  /** Restore although the GPUs differ from the snapshot's (422 gpu_mismatch). */
  force?: boolean;
}

/** POST /infinijup/restore reply (200). */
export interface IRestoreResult {
  kernel_id: string;
  commit: string;
  /** null when the next snapshot starts a new thread. */
  thread: string | null;
  duration_s: number;
}

/** POST /infinijup/branch body: a new thread at the kernel's HEAD, kernel untouched. */
export interface IBranchRequest {
  kernel_id: string;
  name: string;
}

/** POST /infinijup/branch reply (200). */
export interface IBranchResult {
  kernel_id: string;
  thread: string;
  commit: string | null;
}

/** POST /infinijup/resume body: start a new kernel from a commit. */
export interface IResumeRequest {
  /** The notebook whose history holds the commit. */
  path: string;
  commit: string;
  kernel_name?: string;
  /** Copy the notebook to a new file and resume there. */
  new_notebook?: boolean;
  /** false: start the kernel without a session (the client opens the notebook on it). */
  session?: boolean;
}

/** POST /infinijup/resume reply (200). */
export interface IResumeResult {
  kernel_id: string;
  session_id: string;
  /** The notebook the new kernel belongs to (a new file with `new_notebook`). */
  path: string;
  commit: string;
  thread: string | null;
  duration_s: number;
}

/**
 * POST /infinijup/delete body: a snapshot (`commit`) or a thread of the
 * notebook (its kernel's, or `path`'s). 409 with the reason when a kernel
 * stands on it or other snapshots build on it (docs/space.md).
 */
export interface IDeleteRequest {
  kernel_id?: string;
  path?: string;
  commit?: string;
  thread?: string;
}

/** POST /infinijup/delete reply (200). */
export interface IDeleteResult {
  path: string;
  /** The snapshot deleted (null for a thread). */
  commit: string | null;
  /** The thread deleted (null for a snapshot). */
  thread: string | null;
  /** Thread -> its new tip (null: the thread was removed). */
  threads: { [name: string]: string | null };
  /** Snapshots that left the store. */
  removed: string[];
  store_bytes: number;
  freed_bytes: number;
  hot_dropped: number;
  hot_freed_bytes: number;
}

/** GET /infinijup/stats reply. */
export interface ISpaceStats {
  /** Bytes the store takes on disk. */
  store_bytes: number;
  commits: number;
  threads: number;
  /** Bytes of the hot tier (uncompressed recent images); null: unknown. */
  hot_bytes: number | null;
  hot_entries: number | null;
  hot_budget: number;
  /** "Store 42.9 MiB · hot copies 2.51 GiB" */
  text: string;
}

/** Deleting and sizes, apart from IInfinijupAPI (so its fakes need not change). */
export interface ISpaceAPI {
  deleteFromHistory(body: IDeleteRequest): Promise<IDeleteResult>;
  spaceStats(): Promise<ISpaceStats>;
}

/** An operation in progress, as reported by GET /infinijup/status. */
export interface IOperationStatus {
  op: OperationKind;
  phase: OperationPhase;
  percent: number;
}

/** GET /infinijup/status reply. */
export interface IKernelStatus {
  kernel_id: string;
  managed: boolean;
  operation: IOperationStatus | null;
}

export type OperationKind = 'snapshot' | 'restore' | 'resume';

export type OperationPhase =
  | 'queued'
  | 'quiesce'
  | 'gpu'
  | 'dump'
  | 'store'
  | 'commit'
  | 'kill'
  | 'restore'
  | 'reconnect'
  | 'done'
  | 'error';

/** One operation event (schema EVENT_SCHEMA_ID, version 1). */
export interface IOperationEvent {
  op: OperationKind;
  op_id: string;
  kernel_id: string;
  path: string;
  phase: OperationPhase;
  percent: number;
  message: string;
  /** Present on `done`. */
  commit?: string;
  thread?: string;
  /** Present on `error`. */
  reason?: string;
  /**
   * An automatic snapshot, or a step of an undo or redo: no notification of
   * its own (the history still follows it).
   */
  quiet?: boolean;
}

/** The query of a history request: by kernel (preferred) or notebook path. */
export interface IHistoryQuery {
  kernel_id?: string;
  path?: string;
}

/**
 * The server API, as an interface so that models can be tested with fakes.
 */
export interface IInfinijupAPI {
  snapshot(body: ISnapshotRequest): Promise<ISnapshotResult>;
  restore(body: IRestoreRequest): Promise<IRestoreResult>;
  branch(body: IBranchRequest): Promise<IBranchResult>;
  resume(body: IResumeRequest): Promise<IResumeResult>;
  history(query: IHistoryQuery): Promise<IHistory>;
  status(kernelId: string): Promise<IKernelStatus>;
}

/** Human readable labels of the phases. */
export const PHASE_LABELS: { [phase in OperationPhase]: string } = {
  queued: 'Queued',
  quiesce: 'Waiting for the kernel to be idle',
  gpu: 'Saving GPU state',
  dump: 'Dumping the process',
  store: 'Storing the image',
  commit: 'Committing',
  kill: 'Stopping the current kernel',
  restore: 'Restoring the process',
  reconnect: 'Reconnecting the kernel',
  done: 'Done',
  error: 'Failed'
};

/**
 * Parse an event-bus emission into an operation event, or null when it is not
 * one (other schema, missing fields).
 */
export function parseOperationEvent(emission: {
  [key: string]: any;
}): IOperationEvent | null {
  if (!emission || emission.schema_id !== EVENT_SCHEMA_ID) {
    return null;
  }
  const { op, op_id, kernel_id, phase } = emission;
  if (
    (op !== 'snapshot' && op !== 'restore' && op !== 'resume') ||
    typeof op_id !== 'string' ||
    typeof kernel_id !== 'string' ||
    typeof phase !== 'string'
  ) {
    return null;
  }
  const percent = Number(emission.percent);
  return {
    op,
    op_id,
    kernel_id,
    path: typeof emission.path === 'string' ? emission.path : '',
    phase: phase as OperationPhase,
    percent: Number.isFinite(percent) ? Math.max(0, Math.min(100, percent)) : 0,
    message: typeof emission.message === 'string' ? emission.message : '',
    commit: typeof emission.commit === 'string' ? emission.commit : undefined,
    thread: typeof emission.thread === 'string' ? emission.thread : undefined,
    reason: typeof emission.reason === 'string' ? emission.reason : undefined,
    quiet: emission.quiet === true
  };
}
