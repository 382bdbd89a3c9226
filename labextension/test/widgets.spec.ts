import { Widget } from '@lumino/widgets';

import {
  commitTooltip,
  describeVariable,
  formatAge,
  formatBytes,
  formatSeconds,
  hasGpu,
  isValidThreadName,
  shortId
} from '../src/format';
import { esc, GraphView, rowSvg } from '../src/graphview';
import { ManagedKernels } from '../src/kernels';
import { layoutGraph } from '../src/layout';
import { HistoryModel } from '../src/model';
import type { IHistory, IInfinijupAPI } from '../src/types';
import { commit, linearHistory } from './synthetic';

describe('format', () => {
  it('shows a variable with its value where one was recorded (issue 28)', () => {
    const counter = {
      name: 'counter',
      type: 'int',
      size: 28,
      shape: null,
      fp: 'x',
      changed: true
    };
    expect(describeVariable(counter)).toBe('int, 28 B');
    expect(describeVariable({ ...counter, value: '111' })).toBe(
      '111 (int, 28 B)'
    );
    expect(
      describeVariable({
        ...counter,
        type: 'ndarray',
        shape: '(1000,)',
        size: 8000,
        value: 'min 0, max 999, mean 499.5'
      })
    ).toBe('min 0, max 999, mean 499.5 (ndarray (1000,), 7.81 KiB)');
  });

  it('formats sizes, durations, ages and ids', () => {
    expect(formatBytes(0)).toBe('0 B');
    expect(formatBytes(1536)).toBe('1.50 KiB');
    expect(formatBytes(3 * 1024 ** 3)).toBe('3.00 GiB');
    expect(formatBytes(150 * 1024 ** 2)).toBe('150 MiB');
    expect(formatBytes(undefined)).toBe('–');
    expect(formatSeconds(0.0123)).toBe('12 ms');
    expect(formatSeconds(2.54)).toBe('2.5 s');
    expect(formatSeconds(75)).toBe('1 min 15 s');
    expect(formatSeconds(120)).toBe('2 min');
    const now = 1_000_000_000_000;
    expect(formatAge(now / 1000 - 10, now)).toBe('just now');
    expect(formatAge(now / 1000 - 300, now)).toBe('5 min ago');
    expect(formatAge(now / 1000 - 7200, now)).toBe('2 h ago');
    expect(formatAge(now / 1000 - 3 * 86400, now)).toBe('3 d ago');
    expect(formatAge(0, now)).toBe('');
    expect(shortId('0123456789abcdef')).toBe('01234567');
    expect(shortId(null)).toBe('');
  });

  it('checks thread names like the server', () => {
    expect(isValidThreadName('exp-1')).toBe(true);
    expect(isValidThreadName('lr.3e-4_b')).toBe(true);
    expect(isValidThreadName('-x')).toBe(false);
    expect(isValidThreadName('a--b')).toBe(false);
    expect(isValidThreadName('a/b')).toBe(false);
    expect(isValidThreadName('x'.repeat(65))).toBe(false);
    expect(isValidThreadName('')).toBe(false);
  });

  it('tells GPU commits and describes commits', () => {
    const c = commit('abc', [], 'main', 1, 'hello');
    expect(hasGpu(c)).toBe(false);
    c.metadata = { gpu: { devices: 1 } };
    c.stats.gpu_bytes = 1024;
    expect(hasGpu(c)).toBe(true);
    expect(commitTooltip(c)).toContain('GPU state 1.00 KiB');
    expect(commitTooltip(c).split('\n')[0]).toBe('hello');
    expect(esc('<a href="x">&\'</a>')).toBe(
      '&lt;a href=&quot;x&quot;&gt;&amp;&#39;&lt;/a&gt;'
    );
  });
});

describe('ManagedKernels', () => {
  function api(status: IInfinijupAPI['status']): IInfinijupAPI {
    return {
      status,
      history: jest.fn(),
      snapshot: jest.fn(),
      restore: jest.fn(),
      branch: jest.fn(),
      resume: jest.fn()
    };
  }

  it('asks the server once per kernel and signals the answer', async () => {
    const status = jest.fn(async (id: string) => ({
      kernel_id: id,
      managed: id === 'k1',
      operation: null
    }));
    const managed = new ManagedKernels(api(status));
    const changed: string[] = [];
    managed.changed.connect((_, id) => changed.push(id));
    // Before the answer: a guess from the kernelspec name.
    expect(managed.isManaged({ id: 'k1', name: 'python3' })).toBe(false);
    expect(managed.isManaged({ id: 'k2', name: 'infinijup' })).toBe(true);
    await managed.check({ id: 'k1', name: 'python3' });
    await managed.check({ id: 'k2', name: 'infinijup' });
    await Promise.resolve();
    expect(managed.isManaged({ id: 'k1', name: 'python3' })).toBe(true);
    expect(managed.isManaged({ id: 'k2', name: 'infinijup' })).toBe(false);
    expect(status).toHaveBeenCalledTimes(2);
    expect(changed.sort()).toEqual(['k1', 'k2']);
    expect(managed.isManaged(null)).toBe(false);
  });

  it('falls back to the kernelspec when the server cannot say', async () => {
    const warn = jest
      .spyOn(console, 'warn')
      .mockImplementation(() => undefined);
    const managed = new ManagedKernels(
      api(() => Promise.reject(new Error('404')))
    );
    expect(await managed.check({ id: 'a', name: 'infinijup' })).toBe(true);
    expect(await managed.check({ id: 'b', name: 'python3' })).toBe(false);
    warn.mockRestore();
  });
});

describe('GraphView', () => {
  function modelWith(history: IHistory): HistoryModel {
    const api: IInfinijupAPI = {
      history: async () => history,
      status: jest.fn(),
      snapshot: jest.fn(),
      restore: jest.fn(),
      branch: jest.fn(),
      resume: jest.fn()
    };
    return new HistoryModel({ api, refreshDelay: 0, collapse: false });
  }

  it('renders only the rows near the viewport and selects on click', async () => {
    const commits = linearHistory(1000);
    const model = modelWith({
      commits,
      threads: { main: 'c999' },
      head: { thread: 'main', commit: 'c999' }
    });
    const view = new GraphView(model);
    Widget.attach(view, document.body);
    model.setTarget({ path: 'a.ipynb', kernelId: 'k' });
    await new Promise(r => setTimeout(r, 0));

    expect(view.node.dataset.rows).toBe('1000');
    const rows = view.node.querySelectorAll('.jp-Infinijup-row');
    // jsdom has no layout: the default 40 rows plus the overscan.
    expect(rows.length).toBeLessThan(60);
    expect(view.renderedRows).toBe(rows.length);
    const head = view.node.querySelector(
      '.jp-Infinijup-row.jp-mod-head'
    ) as HTMLElement;
    expect(head.dataset.commitId).toBe('c999');
    expect(head.querySelector('.jp-Infinijup-chip-head')).not.toBeNull();
    expect(head.querySelector('.jp-Infinijup-chip-thread')!.textContent).toBe(
      'main'
    );

    const second = view.node.querySelector('[data-row="1"]') as HTMLElement;
    second.click();
    expect(model.selected).toBe('c998');
    expect(second.classList.contains('jp-mod-selected')).toBe(true);

    view.node.dispatchEvent(new KeyboardEvent('keydown', { key: 'ArrowDown' }));
    expect(model.selected).toBe('c997');

    Widget.detach(view);
    view.dispose();
    model.dispose();
  });

  it('expands a collapsed run on click', async () => {
    const model = modelWith({
      commits: linearHistory(40),
      threads: { main: 'c39' },
      head: { thread: 'main', commit: 'c39' }
    });
    model.collapse = true;
    const view = new GraphView(model);
    Widget.attach(view, document.body);
    model.setTarget({ path: 'a.ipynb', kernelId: 'k' });
    await new Promise(r => setTimeout(r, 0));
    const run = view.node.querySelector(
      '.jp-Infinijup-row.jp-mod-collapsed'
    ) as HTMLElement;
    expect(run.textContent).toContain('35 more commits on main');
    run.click();
    expect(view.node.dataset.rows).toBe('40');
    Widget.detach(view);
    view.dispose();
  });

  it('draws lanes: straight lines in a lane, curves between lanes', () => {
    const layout = layoutGraph([
      commit('X1', ['A'], 'x', 3),
      commit('B', ['A'], 'main', 2),
      commit('A', [], 'main', 1)
    ]);
    const svgA = rowSvg(layout.rows[2], 40, false);
    expect(svgA).toContain('<circle');
    expect((svgA.match(/<path/g) ?? []).length).toBe(2); // two lines come in
    expect(svgA).toMatch(/C/); // one of them curves from lane 1
    const svgB = rowSvg(layout.rows[1], 40, true);
    expect(svgB).toContain('jp-mod-head');
  });
});
