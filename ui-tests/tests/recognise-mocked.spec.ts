/**
 * Commits people can recognise (issue 18), with the Infinijup API mocked:
 * rows labelled by the last cell, the variables a commit changed, search by
 * variable name, comparing two commits. Older snapshots without the kernel's
 * description still read sensibly.
 */

import { expect, test } from '@jupyterlab/galata';

import {
  createNotebook,
  currentKernelId,
  demoHistory,
  hex,
  MockBackend,
  openHistory,
  screenshot,
  widenRightPanel
} from './helpers';

test.use({ autoGoto: false });

const short = (tag: string) => hex(tag).slice(0, 8);

test.describe('Commits people can recognise @mocked', () => {
  test.beforeEach(async ({ page }, testInfo) => {
    const backend = new MockBackend();
    backend.history = demoHistory(Math.floor(Date.now() / 1000));
    await backend.install(page);
    await page.goto();
    // One notebook per test (the tests share the server's root).
    const name = `train-${testInfo.title.split(' ')[0]}.ipynb`;
    await createNotebook(page, name);
    await currentKernelId(page);
    await openHistory(page);
    await widenRightPanel(page, 420);
  });

  const row = (page: any, tag: string) =>
    page.locator(
      `#infinijup-history .jp-Infinijup-row[data-commit-id="${hex(tag)}"]`
    );

  test('rows read as the cell behind them; the card lists the changed variables', async ({
    page
  }, testInfo) => {
    const messages = page.locator(
      '#infinijup-history .jp-Infinijup-row-message'
    );
    await expect(messages).toHaveText([
      'before plotting',
      '(no message)', // b2: an older snapshot, no description
      '[13] acc = evaluate(model, X_val, y_val)',
      'sklearn baseline',
      '[12] train(model, opt, lr=3e-4, epochs=1)',
      '[10] losses = train(model, opt, epochs=1)',
      '[11] train(model, opt, lr=3e-4, epochs=1)',
      'model on GPU, epoch 0',
      '[5] X, y = featurize(df, tokenizer)',
      'load data (12 GB parquet)'
    ]);
    await row(page, 'm2').click();
    const card = page.locator('#infinijup-history .jp-Infinijup-details');
    await expect(card.locator('.jp-Infinijup-details-title')).toHaveText(
      '[5] X, y = featurize(df, tokenizer)'
    );
    await expect(
      card.locator('.jp-Infinijup-vars .jp-Infinijup-section')
    ).toHaveText('Changed variables (3 of 4, since its parent)');
    const changed = card.locator(
      '.jp-Infinijup-vars > .jp-Infinijup-vartable tr'
    );
    await expect(changed).toHaveText([
      /^X\s*ndarray \(1200000, 64\)\s*586 MiB$/,
      /^y\s*ndarray \(1200000,\)\s*9\.20 MiB$/,
      /^tokenizer\s*Tokenizer\s*31\.0 MiB$/
    ]);
    await screenshot(page.locator('#infinijup-history'), testInfo, 'variables');

    // A commit with a message shows its cell too; an older one says what is missing.
    await row(page, 'm3').click();
    await expect(card.locator('.jp-Infinijup-cell')).toHaveText(
      '[8] model = Net(d=64).cuda(); opt = AdamW(model)'
    );
    await row(page, 'b2').click();
    await expect(card.locator('.jp-Infinijup-vars')).toContainText(
      'not recorded for this snapshot'
    );
  });

  test('search finds the commits that changed a variable', async ({
    page
  }, testInfo) => {
    const panel = page.locator('#infinijup-history');
    const search = panel.getByRole('searchbox', { name: 'Search snapshots' });
    await search.fill('tokenizer');
    await expect(panel.locator('.jp-Infinijup-search-count')).toHaveText(
      '1 of 10'
    );
    await expect(panel.locator('.jp-Infinijup-row.jp-mod-match')).toHaveCount(
      1
    );
    await expect(panel.locator('.jp-Infinijup-row.jp-mod-dimmed')).toHaveCount(
      9
    );
    await search.press('Enter');
    await expect(row(page, 'm2')).toHaveClass(/jp-mod-selected/);

    // "model": changed in 4 commits, named in one more cell (evaluate(model)).
    await search.fill('model');
    await expect(panel.locator('.jp-Infinijup-search-count')).toHaveText(
      '5 of 10'
    );
    const matched = await panel
      .locator('.jp-Infinijup-row.jp-mod-match')
      .evaluateAll(rows => rows.map(r => (r as HTMLElement).dataset.commitId));
    expect(matched.sort()).toEqual(
      ['m5', 'a2', 'm4', 'a1', 'm3'].map(hex).sort()
    );
    // Enter: the first match in the graph (newest first).
    await search.press('Enter');
    await expect(row(page, 'm5')).toHaveClass(/jp-mod-selected/);
    await search.press('Enter');
    await expect(row(page, 'a2')).toHaveClass(/jp-mod-selected/);
    await screenshot(panel, testInfo, 'search');
    await search.press('Escape');
    await expect(panel.locator('.jp-Infinijup-row.jp-mod-dimmed')).toHaveCount(
      0
    );
  });

  test('compare two commits: which variables differ', async ({
    page
  }, testInfo) => {
    await row(page, 'm4').click();
    const card = page.locator('#infinijup-history .jp-Infinijup-details');
    await card.getByRole('button', { name: 'Compare…' }).click();
    await expect(page.locator('.jp-Infinijup-picking')).toContainText(
      `Click the commit to compare with ${short('m4')}`
    );
    await row(page, 'a2').click();
    await expect(row(page, 'm4')).toHaveClass(/jp-mod-selected/);
    await expect(row(page, 'a2')).toHaveClass(/jp-mod-compare/);
    const diffs = card.locator('.jp-Infinijup-diffs li');
    await expect(diffs).toHaveText([
      /^history only in [0-9a-f]{8} \(list len 2, 8\.00 KiB\)$/,
      /^losses only in [0-9a-f]{8} \(list len 938, 8\.00 KiB\)$/,
      /^model differs: Net, 1\.10 GiB → Net, 1\.10 GiB$/,
      /^opt differs: AdamW, 2\.20 GiB → AdamW, 2\.20 GiB$/
    ]);
    await expect(diffs.nth(0).locator('code').last()).toHaveText(short('a2'));
    await expect(diffs.nth(1).locator('code').last()).toHaveText(short('m4'));
    await expect(card.locator('.jp-Infinijup-compare')).toContainText(
      '4 differ, 4 identical.'
    );
    await screenshot(page.locator('#infinijup-history'), testInfo, 'compare');

    // Ctrl+click compares directly; Stop ends it.
    await row(page, 'm6').click({ modifiers: ['Control'] });
    await expect(card.locator('.jp-Infinijup-diffs li')).toHaveText([
      /^acc only in/,
      /^ax only in/,
      /^fig only in/
    ]);
    await card.getByRole('button', { name: 'Stop' }).click();
    await expect(card.locator('.jp-Infinijup-compare')).toHaveCount(0);
  });
});
