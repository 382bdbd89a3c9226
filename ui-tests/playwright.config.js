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
 *
 * Each run starts its own JupyterLab on a free port (INFINIJUP_UI_PORT picks
 * one) and never reuses a server already listening there: a foreign server
 * (a developer's `make lab` on 8888, another run) would test other code
 * against another store. The runner picks the port and a run id once; the
 * workers, which load this file again, inherit both through the environment.
 * tests/own-server.spec.ts checks that the server is this run's.
 */
const { execFileSync } = require('child_process');
const crypto = require('crypto');

const baseConfig = require('@jupyterlab/galata/lib/playwright-config');

if (!process.env.INFINIJUP_UI_PORT) {
  // Ask the kernel for a free port (a child process: the config is sync).
  process.env.INFINIJUP_UI_PORT = execFileSync(process.execPath, [
    '-e',
    "const s = require('net').createServer();" +
      "s.listen(0, '127.0.0.1', () => { process.stdout.write(String(s.address().port)); s.close(); });"
  ])
    .toString()
    .trim();
}
if (!process.env.INFINIJUP_UI_RUN_ID) {
  process.env.INFINIJUP_UI_RUN_ID = crypto.randomBytes(8).toString('hex');
}
const PORT = Number(process.env.INFINIJUP_UI_PORT);
const BASE_URL = `http://localhost:${PORT}`;

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
    baseURL: BASE_URL,
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
    command: `jlpm start --ServerApp.port=${PORT}`,
    url: `${BASE_URL}/lab`,
    timeout: 120 * 1000,
    // Never: a server already on the port is not this run's (Playwright then
    // stops with "already used").
    reuseExistingServer: false
  }
};
