import {
  autoThreadName,
  cellLabel,
  changedVariables,
  commitTitle,
  compareCommits,
  matchesQuery,
  nextSnapshot,
  removedVariables,
  resolveRef,
  sidecarsOf,
  variablesOf
} from '../src/commits';
import { commitTooltip } from '../src/format';
import type { ICommit, IVariableInfo } from '../src/types';
import { commit } from './synthetic';

function v(
  name: string,
  fp: string,
  changed = false,
  over: Partial<IVariableInfo> = {}
): IVariableInfo {
  return {
    name,
    type: 'int',
    size: 28,
    shape: null,
    fp,
    changed,
    ...over
  };
}

/** A commit without message nor metadata (an older snapshot). */
function bare(id: string, parents: string[] = [], created = 1): ICommit {
  const c = commit(id, parents, 'main', created);
  c.message = '';
  return c;
}

/** A commit with the kernel's metadata (cell, variables). */
function described(
  id: string,
  parents: string[],
  cell: { execution_count: number | null; source: string } | null,
  items: IVariableInfo[] | null,
  message = '',
  truncated = false
): ICommit {
  const c = bare(id, parents);
  c.message = message;
  c.metadata = {
    ...(cell ? { cell } : {}),
    ...(items ? { variables: { items, truncated } } : {})
  };
  return c;
}

describe('commit labels', () => {
  it('prefers the message, else "[N] first line of the cell"', () => {
    const withCell = described(
      'a',
      [],
      { execution_count: 12, source: 'df = load("x.parquet")' },
      null
    );
    expect(commitTitle(withCell)).toBe('[12] df = load("x.parquet")');
    expect(cellLabel(withCell)).toBe('[12] df = load("x.parquet")');

    const withMessage = described(
      'b',
      [],
      { execution_count: 3, source: 'x = 1' },
      null,
      'before the experiment\nmore lines'
    );
    expect(commitTitle(withMessage)).toBe('before the experiment');
    expect(cellLabel(withMessage)).toBe('[3] x = 1');
    expect(commitTooltip(withMessage).split('\n').slice(0, 2)).toEqual([
      'before the experiment',
      'cell [3] x = 1'
    ]);
  });

  it('takes only the first non-empty line of a source', () => {
    const c = described(
      'a',
      [],
      { execution_count: null, source: '\n  # load\nx = 1' },
      null
    );
    expect(commitTitle(c)).toBe('[ ] # load');
  });

  it('tolerates older snapshots and malformed metadata', () => {
    const old = bare('a');
    expect(commitTitle(old)).toBe('(no message)');
    expect(cellLabel(old)).toBeNull();
    expect(variablesOf(old)).toBeNull();
    expect(changedVariables(old)).toBeNull();

    // Older snapshots carry the server's execution_count only.
    old.metadata = { execution_count: 7 };
    expect(commitTitle(old)).toBe('after cell [7]');

    const bad = bare('b');
    bad.metadata = {
      cell: 'nope',
      variables: {
        items: [
          null,
          3,
          { name: 5 },
          { name: 'ok', size: 'x' },
          { name: 'kept', type: 'int', value: '111', partial: true, value2: 1 }
        ]
      }
    };
    expect(commitTitle(bad)).toBe('(no message)');
    expect(variablesOf(bad)).toEqual({
      items: [
        {
          name: 'ok',
          type: '?',
          size: 0,
          shape: null,
          fp: '',
          changed: false
        },
        {
          name: 'kept',
          type: 'int',
          size: 0,
          shape: null,
          fp: '',
          changed: false,
          value: '111',
          partial: true
        }
      ],
      truncated: false
    });
    bad.metadata = { variables: { items: 'nope' } };
    expect(variablesOf(bad)).toBeNull();
  });
});

describe('sidecars', () => {
  it('reads what the kernel recorded and drops what is malformed', () => {
    const c = commit('s', []);
    expect(sidecarsOf(c)).toEqual([]);
    c.metadata = {
      sidecars: [
        {
          name: 'server',
          argv: ['python', '-m', 'http.server', 7],
          running: true
        },
        { name: 'old', argv: 'not a list', running: false },
        { argv: ['no name'] },
        null
      ]
    };
    expect(sidecarsOf(c)).toEqual([
      { name: 'server', argv: ['python', '-m', 'http.server'], running: true },
      { name: 'old', argv: [], running: false }
    ]);
  });
});

describe('variables', () => {
  const parent = described('p', [], null, [v('a', '1'), v('gone', '9')]);
  const child = described(
    'c',
    ['p'],
    { execution_count: 2, source: 'a = 2; df = f()' },
    [
      v('a', '2', true),
      v('df', '5', true, { type: 'DataFrame', shape: '(3, 2)', size: 4096 }),
      v('count', '7')
    ]
  );

  it('lists the changed ones and the deleted ones', () => {
    expect(changedVariables(child)!.map(x => x.name)).toEqual(['a', 'df']);
    expect(removedVariables(child, parent)).toEqual(['gone']);
    expect(removedVariables(child, undefined)).toEqual([]);
    // Nothing is known beyond a truncated list.
    const truncated = described(
      't',
      ['p'],
      null,
      [v('a', '2', true)],
      '',
      true
    );
    expect(removedVariables(truncated, parent)).toEqual([]);
    expect(commitTooltip(child)).toContain('changed: a, df');
  });

  it('searches by message, cell, id, thread and changed variable names', () => {
    expect(matchesQuery(child, '')).toBe(true);
    expect(matchesQuery(child, 'df')).toBe(true); // changed variable (and cell)
    expect(matchesQuery(child, 'DF')).toBe(true);
    expect(matchesQuery(child, 'count')).toBe(false); // unchanged, not in text
    expect(matchesQuery(child, 'var:count')).toBe(true); // any variable
    expect(matchesQuery(child, 'var:zzz')).toBe(false);
    expect(matchesQuery(child, 'var:')).toBe(false);
    expect(matchesQuery(child, 'a = 2')).toBe(true); // words of the cell
    expect(matchesQuery(child, 'c')).toBe(true); // id prefix
    expect(matchesQuery(child, 'main')).toBe(true); // thread
    expect(matchesQuery(parent, 'gone')).toBe(false); // present, not changed
    const msg = described('m', [], null, null, 'after loading the data');
    expect(matchesQuery(msg, 'loading data')).toBe(true);
    expect(matchesQuery(msg, 'loading model')).toBe(false);
  });

  it('compares two commits: only in one, or another fingerprint', () => {
    const a = described('a', [], null, [
      v('x', '1'),
      v('y', '2'),
      v('only_a', '3'),
      v('t', '4', false, { type: 'int' })
    ]);
    const b = described('b', [], null, [
      v('x', '1'),
      v('y', '22'),
      v('only_b', '5'),
      v('t', '4', false, { type: 'float' })
    ]);
    const cmp = compareCommits(a, b);
    expect(cmp.available).toBe(true);
    expect(cmp.partial).toBe(false);
    expect(cmp.same).toEqual(['x']);
    expect(cmp.diffs.map(d => [d.name, d.kind])).toEqual([
      ['only_a', 'only-a'],
      ['only_b', 'only-b'],
      ['t', 'changed'],
      ['y', 'changed']
    ]);
    expect(cmp.diffs.find(d => d.name === 'y')!.b!.fp).toBe('22');

    // A truncated side: what is missing from it is not known.
    const c = described('c', [], null, [v('x', '1')], '', true);
    const partial = compareCommits(a, c);
    expect(partial.partial).toBe(true);
    expect(partial.diffs).toEqual([]);
    expect(partial.same).toEqual(['x']);
    expect(compareCommits(c, a).diffs).toEqual([]);

    const old = bare('o');
    expect(compareCommits(a, old)).toEqual({
      available: false,
      diffs: [],
      same: [],
      partial: false
    });
  });
});

describe('nextSnapshot (heads.py plan_snapshot)', () => {
  it('uses the thread the server planned', () => {
    expect(
      nextSnapshot(
        { thread: null, commit: 'c1', next_thread: 'main-1' },
        { main: 'c2' }
      )
    ).toEqual({ thread: 'main-1', isNew: true, parent: 'c1' });
  });

  it('continues a thread whose tip is HEAD', () => {
    expect(
      nextSnapshot({ thread: 'main', commit: 'c2' }, { main: 'c2' })
    ).toEqual({ thread: 'main', isNew: false, parent: 'c2' });
  });

  it('starts a new thread after restoring a commit that is not a tip', () => {
    // The restore's reply: thread null; the commit was made on main.
    expect(
      nextSnapshot({ thread: null, commit: 'c1' }, { main: 'c2' }, 'main')
    ).toEqual({ thread: 'main-1', isNew: true, parent: 'c1' });
    // A head thread whose tip moved on: a new thread next to it.
    expect(
      nextSnapshot(
        { thread: 'main', commit: 'c1' },
        { main: 'c2', 'main-1': 'c3' }
      )
    ).toEqual({ thread: 'main-2', isNew: true, parent: 'c1' });
    expect(
      nextSnapshot({ thread: null, commit: 'x' }, { 'exp-1': 'y' }, 'exp-1')
    ).toEqual({ thread: 'exp-2', isNew: true, parent: 'x' });
  });

  it('starts a fresh kernel on a new root next to its thread', () => {
    expect(
      nextSnapshot({ thread: 'main', commit: null }, { main: 'c2' })
    ).toEqual({ thread: 'main-1', isNew: true, parent: null });
    expect(
      nextSnapshot({ thread: 'exp', commit: null }, { main: 'c2' })
    ).toEqual({ thread: 'exp', isNew: true, parent: null });
    expect(nextSnapshot(null, {})).toEqual({
      thread: 'main',
      isNew: true,
      parent: null
    });
  });

  it('names new threads like naming.py', () => {
    expect(autoThreadName('main', new Set())).toBe('main-1');
    expect(autoThreadName('main-3', new Set(['main-1']))).toBe('main-2');
    expect(autoThreadName('-1', new Set())).toBe('main-1');
  });
});

describe('resolveRef', () => {
  const commits = [bare('aaaa1111', [], 2), bare('aaaa2222', [], 1)];
  const threads = { main: 'aaaa1111', ghost: 'ffff0000' };

  it('finds ids, prefixes and thread names, or says why not', () => {
    expect(resolveRef(commits, threads, 'aaaa2222')).toBe(commits[1]);
    expect(resolveRef(commits, threads, ' aaaa22 ')).toBe(commits[1]);
    expect(resolveRef(commits, threads, 'main')).toBe(commits[0]);
    expect(resolveRef(commits, threads, 'AAAA1')).toBe(commits[0]);
    expect(resolveRef(commits, threads, 'aaaa')).toBe('ambiguous');
    expect(resolveRef(commits, threads, 'deadbeef')).toBe('missing');
    expect(resolveRef(commits, threads, 'ghost')).toBe('missing');
    expect(resolveRef(commits, threads, 'nope')).toBe('missing');
  });
});
