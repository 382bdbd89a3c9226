/**
 * Benchmark: opening the Kernel history panel on large histories, in the UI
 * tests' browser (Debian chromium, headless).
 *
 * The REST API is mocked (tests/helpers.ts MockBackend) with synthetic
 * histories (labextension/test/synthetic.ts: a main thread with branches,
 * about a third of the commits with GPU state). For each size, with long runs
 * collapsed (the default) and expanded, the panel is closed and emptied, then:
 *   t0: "Show Kernel History" + the notebook's history requested,
 *   the reply arrives (fetch), the layout is computed (layout), the visible
 *   rows are put in the DOM (render), t1: the next animation frame (painted).
 * Then scrolling: the cost of drawing the rows of each new viewport.
 *
 * Run: cd ui-tests && jlpm bench   (prints a table; writes
 * test-results/<test>/history-bench.{json,md}).
 */

import * as fs from 'fs';

import { expect, test } from '@jupyterlab/galata';

import { syntheticHistory } from '../../labextension/test/synthetic';
import { currentKernelId, MockBackend, openHistory } from '../tests/helpers';

test.use({ autoGoto: false });

const SIZES = [100, 1000, 5000];
const REPEAT = 9;

interface ISample {
  total: number;
  dom: number;
  fetch: number;
  layout: number;
  render: number;
  rows: number;
  domRows: number;
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

function p95(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.ceil(0.95 * s.length) - 1)];
}

test('history panel: open and scroll', async ({ page, browser }, testInfo) => {
  const backend = new MockBackend();
  await backend.install(page);
  await page.goto();
  await page.notebook.createNew('bench.ipynb', { kernel: 'python3' });
  await currentKernelId(page);
  await openHistory(page);

  const results: {
    commits: number;
    collapse: boolean;
    samples: ISample[];
  }[] = [];

  for (const n of SIZES) {
    backend.history = syntheticHistory(n, { seed: 11, maxThreads: 6 }) as any;
    for (const collapse of [true, false]) {
      const samples: ISample[] = [];
      for (let r = 0; r < REPEAT + 1; r++) {
        const sample = await page.evaluate(async collapse => {
          const app = (window as any).jupyterapp;
          const panel = Array.from(
            app.shell.widgets('right') as Iterable<any>
          ).find((w: any) => w.id === 'infinijup-history');
          const notebook = panel.notebook ?? app.shell.currentWidget;
          const graph: HTMLElement = panel.graph.node;
          // Cold: panel closed, no history loaded.
          app.shell.collapseRight();
          panel.setNotebook(null);
          panel.model.collapse = collapse;
          await new Promise(r =>
            requestAnimationFrame(() => requestAnimationFrame(r))
          );
          performance.clearResourceTimings();

          const drawn = new Promise<number>(resolve => {
            const observer = new MutationObserver(() => {
              if (
                panel.model.state === 'ready' &&
                graph.querySelector('.jp-Infinijup-row')
              ) {
                observer.disconnect();
                resolve(performance.now());
              }
            });
            observer.observe(graph, { childList: true, subtree: true });
          });
          const t0 = performance.now();
          await app.commands.execute('infinijup:show-history');
          panel.setNotebook(notebook);
          const tDom = await drawn;
          await new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)));
          const t1 = performance.now();
          const entries = performance
            .getEntriesByType('resource')
            .filter(e => e.name.includes('/infinijup/history'));
          const fetchEntry = entries[entries.length - 1] as
            PerformanceResourceTiming | undefined;
          return {
            total: t1 - t0,
            dom: tDom - t0,
            fetch: fetchEntry
              ? fetchEntry.responseEnd - fetchEntry.startTime
              : NaN,
            layout: Number(graph.dataset.layoutMs),
            render: Number(graph.dataset.renderMs),
            rows: Number(graph.dataset.rows),
            domRows: graph.querySelectorAll('.jp-Infinijup-row').length
          };
        }, collapse);
        if (r > 0) {
          samples.push(sample); // the first run warms up the JIT
        }
      }
      results.push({ commits: n, collapse, samples });
    }
  }

  // Scrolling 5000 expanded commits, one viewport at a time.
  const scroll = await page.evaluate(async () => {
    const app = (window as any).jupyterapp;
    const panel = Array.from(app.shell.widgets('right') as Iterable<any>).find(
      (w: any) => w.id === 'infinijup-history'
    );
    panel.model.collapse = false;
    const node: HTMLElement = panel.graph.node;
    const costs: number[] = [];
    const frames: number[] = [];
    const max = node.scrollHeight - node.clientHeight;
    for (let top = 0; top < max; top += node.clientHeight) {
      const t0 = performance.now();
      node.scrollTop = top;
      await new Promise(r =>
        requestAnimationFrame(() => requestAnimationFrame(r))
      );
      frames.push(performance.now() - t0);
      costs.push(panel.graph.lastRenderMs);
    }
    return {
      steps: costs.length,
      costs,
      frames,
      domRows: node.querySelectorAll('.jp-Infinijup-row').length
    };
  });

  const version = browser.version();
  const lines: string[] = [];
  lines.push(
    `Chromium ${version} headless, viewport 1400x900, panel ${await page
      .locator('#infinijup-history .jp-Infinijup-graph')
      .evaluate(
        n => `${n.clientWidth}x${n.clientHeight}`
      )} px; ${REPEAT} runs each (after 1 warm-up), ms.`
  );
  lines.push('');
  lines.push(
    '| commits | runs collapsed | rows drawn (in DOM) | open → painted, median | p95 | max | fetch (mocked) median | layout median | render median |'
  );
  lines.push('|---:|:---:|---:|---:|---:|---:|---:|---:|---:|');
  for (const r of results) {
    const s = r.samples;
    lines.push(
      `| ${r.commits} | ${r.collapse ? 'yes' : 'no'} | ${s[0].rows} (${s[0].domRows}) | ${median(
        s.map(x => x.total)
      ).toFixed(1)} | ${p95(s.map(x => x.total)).toFixed(1)} | ${Math.max(
        ...s.map(x => x.total)
      ).toFixed(1)} | ${median(s.map(x => x.fetch)).toFixed(1)} | ${median(
        s.map(x => x.layout)
      ).toFixed(1)} | ${median(s.map(x => x.render)).toFixed(1)} |`
    );
  }
  lines.push('');
  lines.push(
    `Scrolling 5000 expanded rows, ${scroll.steps} viewport jumps: render per jump median ${median(
      scroll.costs
    ).toFixed(
      2
    )} ms, max ${Math.max(...scroll.costs).toFixed(2)} ms; scroll → 2 frames median ${median(
      scroll.frames
    ).toFixed(1)} ms; ${scroll.domRows} rows in the DOM at the end.`
  );
  const table = lines.join('\n');
  console.log('\n' + table + '\n');
  fs.writeFileSync(testInfo.outputPath('history-bench.md'), table + '\n');
  fs.writeFileSync(
    testInfo.outputPath('history-bench.json'),
    JSON.stringify({ chromium: version, results, scroll }, null, 2)
  );

  // Sanity (not a timing assertion): every run drew its rows.
  for (const r of results) {
    for (const s of r.samples) {
      expect(s.domRows).toBeGreaterThan(0);
      expect(s.rows).toBeLessThanOrEqual(r.commits);
    }
  }
});
