/**
 * Playwright configuration of the Infinijup UI tests and benchmarks.
 *
 * - project "ui": tests/*.spec.ts. Tests tagged @backend need the real
 *   Infinijup server extension and an Infinijup kernel (CRIU); tests tagged
 *   @mocked route the REST API and the event socket and need only JupyterLab.
 * - project "bench": bench/*.spec.ts, the rendering benchmark (mocked API);
 *   prints a table and writes test-results/<test>/history-bench.{md,json}.
 *   Defined only when INFINIJUP_BENCH is set (`jlpm bench`), so a plain
 *   `jlpm playwright test` runs the tests and not the benchmark.
 *
 * Playwright cannot download browsers here: Debian's chromium is used
 * (apt-get install -y chromium); override with CHROMIUM_PATH.
 */
const baseConfig = require('@jupyterlab/galata/lib/playwright-config');

const chromium = {
  browserName: 'chromium',
  launchOptions: {
    executablePath: process.env.CHROMIUM_PATH || '/usr/bin/chromium',
    args: [
      '--no-sandbox',
      '--disable-gpu',
      '--disable-background-networking',
      '--disable-component-update',
      '--disable-sync',
      '--no-first-run',
      '--disable-dev-shm-usage'
    ]
  }
};

module.exports = {
  ...baseConfig,
  timeout: 120000,
  expect: { timeout: 30000 },
  retries: 0,
  workers: 1,
  reporter: [
    ['list'],
    ['html', { open: 'never', outputFolder: 'playwright-report' }]
  ],
  outputDir: 'test-results',
  use: {
    ...baseConfig.use,
    ...chromium,
    baseURL: 'http://localhost:8888',
    trace: 'retain-on-failure',
    video: 'off',
    viewport: { width: 1400, height: 900 }
  },
  projects: [
    {
      name: 'ui',
      testDir: './tests',
      testMatch: /.*\.spec\.ts/,
      use: { ...chromium }
    },
    ...(process.env.INFINIJUP_BENCH
      ? [
          {
            name: 'bench',
            testDir: './bench',
            testMatch: /.*\.spec\.ts/,
            timeout: 600000,
            use: { ...chromium }
          }
        ]
      : [])
  ],
  webServer: {
    command: 'jlpm start',
    url: 'http://localhost:8888/lab',
    timeout: 120 * 1000,
    reuseExistingServer: !process.env.CI
  }
};
