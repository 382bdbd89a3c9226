import { InfinijupRequestError } from '../src/errors';
import type { INotifier, NotificationKind } from '../src/progress';
import { IUndoAPI, IUndoResult, UndoActions } from '../src/undo';

/** Records what the user would see. */
class Notes implements INotifier {
  shown: { message: string; type: NotificationKind }[] = [];
  emit(message: string, type: NotificationKind): string {
    this.shown.push({ message, type });
    return String(this.shown.length - 1);
  }
  update(args: {
    id: string;
    message: string;
    type?: NotificationKind;
  }): boolean {
    this.shown[Number(args.id)] = {
      message: args.message,
      type: args.type ?? 'default'
    };
    return true;
  }
  dismiss(): void {
    /* nothing */
  }
}

const moved = (says: string): IUndoResult => ({
  commit: 'b'.repeat(64),
  from: 'a'.repeat(64),
  saved: false,
  says
});

describe('UndoActions', () => {
  it('says where an undo went, and that redo returns', async () => {
    const api: IUndoAPI = {
      undo: async () =>
        moved(
          '3 cells back, to after [11] df = load(): cells [12]-[13] were too quick to snapshot'
        ),
      redo: async () => moved('Redone: back to after [14] fit()'),
      autosnapshot: async () => ({})
    };
    const notes = new Notes();
    const actions = new UndoActions(api, notes);
    await actions.undo('k', 'nb.ipynb');
    expect(notes.shown[0]).toEqual({
      message:
        '3 cells back, to after [11] df = load(): cells [12]-[13] were too quick to snapshot (nb.ipynb) · Redo brings it back',
      type: 'success'
    });
    expect(actions.redoable('k')).toBe(1);
    await actions.redo('k', 'nb.ipynb');
    expect(notes.shown[1].message).toBe(
      'Redone: back to after [14] fit() (nb.ipynb)'
    );
    expect(actions.redoable('k')).toBe(0);
  });

  it('shows nothing-to-undo as information, other failures as errors', async () => {
    let reason = 'nothing_to_undo';
    const api: IUndoAPI = {
      undo: async () => {
        throw new InfinijupRequestError(
          'nothing to undo: no snapshot',
          reason,
          409
        );
      },
      redo: async () => moved(''),
      autosnapshot: async () => ({})
    };
    const notes = new Notes();
    const actions = new UndoActions(api, notes);
    expect(await actions.undo('k', 'nb.ipynb')).toBeNull();
    expect(notes.shown[0]).toEqual({
      message: 'Undo (nb.ipynb): nothing to undo: no snapshot',
      type: 'info'
    });
    reason = 'kernel_busy';
    await actions.undo('k', 'nb.ipynb');
    expect(notes.shown[1].type).toBe('error');
    expect(actions.isBusy('k')).toBe(false);
  });
});
