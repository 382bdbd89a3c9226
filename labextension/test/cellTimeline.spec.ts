import {
  cellPath,
  cellTimeline,
  foldText,
  ITimelineCell,
  skippedText,
  TimelineEntry
} from '../src/cellTimeline';
import type { ICommit } from '../src/types';
import { commit } from './synthetic';

/** A snapshot after cell [n]: automatic unless a message is given. */
function cell(
  id: string,
  parent: string | null,
  n: number,
  source: string,
  options: { message?: string; thread?: string; changed?: string[] } = {}
): ICommit {
  const c = commit(id, parent ? [parent] : [], options.thread ?? 'main', n);
  c.message = options.message ?? '';
  c.metadata = {
    cell: { execution_count: n, source },
    variables: {
      items: (options.changed ?? []).map(name => ({
        name,
        type: 'int',
        size: 28,
        shape: null,
        fp: name,
        changed: true
      })),
      truncated: false
    }
  };
  if (!options.message) {
    c.metadata.auto = true;
  }
  return c;
}

/** Readable rows: "[n]", "fold a..b", with marks. */
function rows(entries: TimelineEntry[]): string[] {
  return entries.map(e =>
    e.kind === 'fold'
      ? `fold ${e.cells.length} ${e.key}`
      : `${e.commit.id}${e.head ? ' HEAD' : ''}${e.ahead ? ' ahead' : ''}`
  );
}

/** A chain of automatic snapshots c1..cN after cells [1]..[N], newest first. */
function chain(n: number, thread = 'main'): ICommit[] {
  const out: ICommit[] = [];
  for (let i = 1; i <= n; i++) {
    out.unshift(
      cell(`c${i}`, i > 1 ? `c${i - 1}` : null, i, `x = ${i}`, { thread })
    );
  }
  return out;
}

describe('cellPath', () => {
  it('follows first parents from the tip of HEAD’s thread', () => {
    const commits = chain(4);
    const { path, headIndex } = cellPath(
      commits,
      { thread: 'main', commit: 'c2' },
      { main: 'c4' }
    );
    expect(path.map(c => c.id)).toEqual(['c4', 'c3', 'c2', 'c1']);
    expect(headIndex).toBe(2);
  });

  it('starts at HEAD when its thread’s tip is on another line', () => {
    const commits = [
      cell('b1', 'c1', 3, 'y = 1', { thread: 'main-1' }),
      ...chain(2)
    ];
    const { path } = cellPath(
      commits,
      { thread: 'main-1', commit: 'c2' },
      { main: 'b1' } // not a descendant of c2
    );
    expect(path.map(c => c.id)).toEqual(['c2', 'c1']);
  });

  it('without a head starts at the newest commit', () => {
    const { path, headIndex } = cellPath(chain(3), null, { main: 'c3' });
    expect(path.map(c => c.id)).toEqual(['c3', 'c2', 'c1']);
    expect(headIndex).toBe(-1);
  });

  it('stops at a parent that is not loaded, and at a cycle', () => {
    const a = cell('a', 'missing', 2, 'a');
    expect(cellPath([a], null, {}).path.map(c => c.id)).toEqual(['a']);
    const x = cell('x', 'y', 2, 'x');
    const y = cell('y', 'x', 1, 'y');
    expect(cellPath([x, y], null, {}).path.map(c => c.id)).toEqual(['x', 'y']);
  });
});

describe('cellTimeline', () => {
  it('marks HEAD and the undone cells above it', () => {
    const entries = cellTimeline(
      chain(4),
      { thread: 'main', commit: 'c2' },
      { main: 'c4' }
    );
    expect(rows(entries)).toEqual(['c4 ahead', 'c3 ahead', 'c2 HEAD', 'c1']);
  });

  it('says which cells made no snapshot', () => {
    const commits = [
      cell('d', 'c', 9, 'plot(df)'),
      cell('c', 'b', 8, 'df = df.dropna()'),
      cell('b', 'a', 5, 'df = load()', { message: 'loaded' }),
      cell('a', null, 1, 'import pandas')
    ];
    const entries = cellTimeline(
      commits,
      { thread: 'main', commit: 'd' },
      {
        main: 'd'
      }
    ) as ITimelineCell[];
    expect(entries.map(e => e.skipped)).toEqual([null, [6, 7], [2, 4], null]);
    expect(skippedText([6, 7])).toBe(
      '2 cells, [6]-[7], made no snapshot (too quick, or changed nothing)'
    );
    expect(skippedText([3, 3])).toMatch(/^cell \[3\] made no snapshot/);
    expect(entries[2].auto).toBe(false);
    expect(entries[1].auto).toBe(true);
  });

  it('no gap across a restart (counts start again)', () => {
    const commits = [cell('b', 'a', 1, 'x = 1'), cell('a', null, 7, 'y = 2')];
    const entries = cellTimeline(commits, null, {}) as ITimelineCell[];
    expect(entries.map(e => e.skipped)).toEqual([null, null]);
  });

  it('folds runs of automatic snapshots, never the newest, HEAD, pinned or manual ones', () => {
    const commits = chain(20);
    commits[10] = cell('c10', 'c9', 10, 'fit()', { message: 'fitted' });
    const entries = cellTimeline(
      commits,
      { thread: 'main', commit: 'c20' },
      { main: 'c20' },
      { pinned: new Set(['c5']), minFold: 4, keepRecent: 3 }
    );
    expect(rows(entries)).toEqual([
      'c20 HEAD',
      'c19',
      'c18', // the newest 3
      'fold 7 c11', // c17..c11
      'c10', // manual
      'fold 4 c6', // c9..c6
      'c5', // pinned
      'fold 4 c1' // c4..c1
    ]);
    const fold = entries[3];
    expect(fold.kind).toBe('fold');
    if (fold.kind === 'fold') {
      expect(foldText(fold)).toBe('cells [11]-[17]: 7 automatic snapshots');
    }
  });

  it('an unfolded run shows each cell', () => {
    const entries = cellTimeline(
      chain(10),
      null,
      { main: 'c10' },
      {
        minFold: 4,
        keepRecent: 2,
        expanded: new Set(['c1'])
      }
    );
    expect(rows(entries)).toEqual([
      'c10',
      'c9',
      'c8',
      'c7',
      'c6',
      'c5',
      'c4',
      'c3',
      'c2',
      'c1'
    ]);
  });

  it('a search shows the matches only, unfolded', () => {
    const commits = chain(12);
    commits[0] = cell('c12', 'c11', 12, 'model.fit(X)', { changed: ['model'] });
    commits[6] = cell('c6', 'c5', 6, 'df = load()', { changed: ['df'] });
    const want = new Set(['c6']);
    const entries = cellTimeline(
      commits,
      null,
      { main: 'c12' },
      {
        matches: id => want.has(id),
        minFold: 2
      }
    );
    expect(rows(entries)).toEqual(['c6']);
    expect((entries[0] as ITimelineCell).changed).toEqual(['df']);
  });

  it('reads commits without cell records', () => {
    const a = commit('a', [], 'main', 1, 'a manual one');
    const entries = cellTimeline([a], null, {}) as ITimelineCell[];
    expect(entries[0]).toMatchObject({
      count: null,
      source: '',
      auto: false,
      changed: [],
      skipped: null
    });
  });
});
