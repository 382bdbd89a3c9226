/**
 * Fakes for the tests of the actions and the panel: a notebook panel with a
 * session context, a notebook tracker, the server API and a notifier.
 */

import { Signal } from '@lumino/signaling';

import type { INotifier, NotificationKind } from '../src/progress';
import type {
  IHistory,
  IInfinijupAPI,
  IRestoreResult,
  IResumeResult
} from '../src/types';

export interface IFakeKernel {
  id: string;
  name: string;
  status: string;
  requestKernelInfo: jest.Mock;
  reconnect: jest.Mock;
}

export function fakeKernel(id: string, name = 'infinijup'): IFakeKernel {
  return {
    id,
    name,
    status: 'idle',
    requestKernelInfo: jest.fn(async () => ({})),
    reconnect: jest.fn(async () => undefined)
  };
}

/** A NotebookPanel as far as the extension looks at it. */
export function fakeNotebook(
  kernel: IFakeKernel | null,
  path = 'nb.ipynb',
  display = kernel?.name === 'infinijup'
    ? 'Python 3 (Infinijup)'
    : 'Python 3 (ipykernel)'
): any {
  const owner = {};
  const ctx: any = {
    session: kernel ? { path, kernel } : null,
    kernelDisplayName: kernel ? display : 'No Kernel',
    kernelChanged: new Signal(owner),
    statusChanged: new Signal(owner),
    propertyChanged: new Signal(owner),
    shutdown: jest.fn(async () => {
      ctx.session = null;
      ctx.kernelDisplayName = 'No Kernel';
      ctx.kernelChanged.emit({});
    }),
    changeKernel: jest.fn(async (model: { id?: string; name?: string }) => {
      // A kernel started by name is the one the fake server resumes into.
      const k = model.id
        ? fakeKernel(model.id)
        : fakeKernel('k-resumed', model.name);
      ctx.session = { path, kernel: k };
      ctx.kernelDisplayName = 'Python 3 (Infinijup)';
      ctx.kernelChanged.emit({});
      return k;
    })
  };
  return {
    id: 'notebook-1',
    sessionContext: ctx,
    context: { path, pathChanged: new Signal(owner) },
    disposed: new Signal(owner),
    activate: jest.fn()
  };
}

export function fakeTracker(panel: any): any {
  return {
    currentWidget: panel,
    find: (fn: (p: any) => boolean) => (panel && fn(panel) ? panel : undefined)
  };
}

/** A server API whose replies the test sets. */
export class FakeAPI implements IInfinijupAPI {
  constructor(public current: IHistory) {}

  /** The history after an operation (the next history() calls). */
  after: IHistory | null = null;
  calls: string[] = [];

  history = jest.fn(async () => {
    this.calls.push('history');
    return this.after ?? this.current;
  });
  status = jest.fn(async (kernelId: string) => ({
    kernel_id: kernelId,
    managed: kernelId.startsWith('k'),
    operation: null
  }));
  snapshot = jest.fn(async () => {
    this.calls.push('snapshot');
    return {
      commit: 'c9'.repeat(32),
      thread: 'main',
      parents: [],
      stats: { image_bytes: 1, stored_bytes: 1, pause_s: 0.1, duration_s: 0.2 }
    };
  });
  restore = jest.fn(async (body: any): Promise<IRestoreResult> => {
    this.calls.push('restore');
    return {
      kernel_id: body.kernel_id,
      commit: body.commit,
      thread: body.branch ?? null,
      duration_s: 0.46
    };
  });
  branch = jest.fn(async (body: any) => {
    this.calls.push('branch');
    return { kernel_id: body.kernel_id, thread: body.name, commit: null };
  });
  resume = jest.fn(async (body: any): Promise<IResumeResult> => {
    this.calls.push('resume');
    return {
      kernel_id: body.new_notebook ? 'k-new-nb' : 'k-resumed',
      session_id: 's1',
      path: body.new_notebook
        ? body.path.replace(/\.ipynb$/, `-${body.commit.slice(0, 8)}.ipynb`)
        : body.path,
      commit: body.commit,
      thread: 'main',
      duration_s: 1.5
    };
  });
}

export interface INote {
  id: string;
  message: string;
  type: NotificationKind;
}

export class FakeNotifier implements INotifier {
  notes: INote[] = [];

  emit(message: string, type: NotificationKind): string {
    const id = `n${this.notes.length}`;
    this.notes.push({ id, message, type });
    return id;
  }

  update(args: INote): boolean {
    const note = this.notes.find(n => n.id === args.id);
    if (note) {
      note.message = args.message;
      note.type = args.type ?? note.type;
    }
    return !!note;
  }

  dismiss(): void {
    // not used
  }
}

export const flush = () => new Promise(resolve => setTimeout(resolve, 0));
