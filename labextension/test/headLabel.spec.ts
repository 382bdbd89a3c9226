import { Signal } from '@lumino/signaling';

import { HeadLabel, headText, IHeadStatus } from '../src/headLabel';

describe('headText', () => {
  it('says which snapshot a managed kernel is in', () => {
    const shown = headText({
      managed: true,
      head: { commit: '1a2b3c4d5e6f', thread: 'main' }
    });
    expect(shown?.text).toBe('at 1a2b3c4d');
    expect(shown?.title).toContain('snapshot 1a2b3c4d (thread main)');
  });

  it('says a fresh kernel stands on no snapshot', () => {
    const shown = headText({ managed: true, head: { commit: null } });
    expect(shown?.text).toBe('no snapshot');
    expect(shown?.title).toContain('started or restarted');
  });

  it('shows nothing for a kernel Infinijup does not manage, or no answer', () => {
    expect(headText({ managed: false, head: { commit: 'abc' } })).toBeNull();
    expect(headText(null)).toBeNull();
  });
});

/** A notebook panel as far as the label reads it. */
function fakePanel(kernelId: string) {
  const owner = {};
  const sessionContext = {
    session: { kernel: { id: kernelId } },
    kernelChanged: new Signal<object, unknown>(owner),
    statusChanged: new Signal<object, string>(owner)
  };
  return { sessionContext } as any;
}

const tick = () => new Promise(resolve => setTimeout(resolve, 0));

describe('HeadLabel', () => {
  it('asks the server again after a restart and shows what it says', async () => {
    const answers: IHeadStatus[] = [
      { managed: true, head: { commit: 'aaaaaaaa1111', thread: 'main' } },
      { managed: true, head: { commit: null } }
    ];
    const asked: string[] = [];
    const label = new HeadLabel({
      api: {
        status: async id => {
          asked.push(id);
          return answers.shift()!;
        }
      },
      onOpen: () => undefined
    });
    const panel = fakePanel('k1');
    label.setNotebook(panel);
    await tick();
    expect(label.node.textContent).toBe('at aaaaaaaa');
    expect(label.isHidden).toBe(false);
    // Restarting, then idle: the label asks once more.
    panel.sessionContext.statusChanged.emit('restarting');
    panel.sessionContext.statusChanged.emit('idle');
    await tick();
    expect(asked).toEqual(['k1', 'k1']);
    expect(label.node.textContent).toBe('no snapshot');
    label.dispose();
  });

  it('hides itself when the server cannot tell', async () => {
    const label = new HeadLabel({
      api: { status: () => Promise.reject(new Error('404')) },
      onOpen: () => undefined
    });
    label.setNotebook(fakePanel('k2'));
    await tick();
    expect(label.isHidden).toBe(true);
    label.dispose();
  });
});
