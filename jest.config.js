/*
 * Jest configuration for the Infinijup JupyterLab extension.
 *
 * Unit tests live in labextension/test/*.spec.ts and cover the pure modules
 * (graph layout, history model, request errors, progress tracking).
 */
const jestJupyterLab = require('@jupyterlab/testing/lib/jest-config');

const esModules = [
  '@codemirror',
  '@jupyter/ydoc',
  '@jupyterlab/',
  'lib0',
  'nanoid',
  'vscode-ws-jsonrpc',
  'y-protocols',
  'y-websocket',
  'yjs'
].join('|');

const baseConfig = jestJupyterLab(__dirname);

module.exports = {
  ...baseConfig,
  automock: false,
  roots: ['<rootDir>/labextension'],
  collectCoverageFrom: [
    'labextension/src/**/*.{ts,tsx}',
    '!labextension/src/**/*.d.ts'
  ],
  // build/ is git-ignored.
  coverageDirectory: '<rootDir>/build/coverage',
  coverageReporters: ['lcov', 'text-summary', 'text'],
  reporters: ['default'],
  testRegex: 'labextension/test/.*\\.spec\\.ts$',
  transformIgnorePatterns: [`/node_modules/(?!${esModules}).+`]
};
