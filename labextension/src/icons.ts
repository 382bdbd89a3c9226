import { LabIcon } from '@jupyterlab/ui-components';

/** A camera shutter: take a snapshot. */
const snapshotSvg = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M9 3 7.2 5H4a2 2 0 0 0-2 2v11a2 2 0 0 0 2 2h16a2 2 0 0 0 2-2V7a2 2 0 0 0-2-2h-3.2L15 3H9zm3 4.5a5 5 0 1 1 0 10 5 5 0 0 1 0-10zm0 2a3 3 0 1 0 0 6 3 3 0 0 0 0-6z"/>
  </g>
</svg>`;

/** A commit graph: the history panel. */
const historySvg = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M6 2a3 3 0 0 0-1 5.83v8.34A3 3 0 1 0 7 16.17v-1.4c.6-1.3 1.9-2.1 3.5-2.27l2.2-.25A5 5 0 0 0 17 7.9V7.83a3 3 0 1 0-2 0v.02a3 3 0 0 1-2.56 2.9l-2.2.25A7 7 0 0 0 7 12.1V7.83A3 3 0 0 0 6 2zm0 2a1 1 0 1 1 0 2 1 1 0 0 1 0-2zm12 0a1 1 0 1 1 0 2 1 1 0 0 1 0-2zM6 18a1 1 0 1 1 0 2 1 1 0 0 1 0-2z"/>
  </g>
</svg>`;

/** Restore: an arrow going back in time. */
const restoreSvg = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M13 3a9 9 0 0 0-9 9H1l3.9 3.9.1.1L9 12H6a7 7 0 1 1 2.05 4.95l-1.42 1.42A9 9 0 1 0 13 3zm-1 5v5l4.25 2.52.77-1.28-3.52-2.09V8H12z"/>
  </g>
</svg>`;

/** Branch: a fork. */
const branchSvg = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M7 2a3 3 0 0 0-1 5.83v8.34A3 3 0 1 0 8 16.2V14c0-1.1.9-2 2-2h4a4 4 0 0 0 4-4v-.17a3 3 0 1 0-2 0V8a2 2 0 0 1-2 2h-4c-.73 0-1.41.2-2 .54V7.83A3 3 0 0 0 7 2zm0 2a1 1 0 1 1 0 2 1 1 0 0 1 0-2zm10 0a1 1 0 1 1 0 2 1 1 0 0 1 0-2zM7 18a1 1 0 1 1 0 2 1 1 0 0 1 0-2z"/>
  </g>
</svg>`;

export const snapshotIcon = new LabIcon({
  name: 'infinijup:snapshot',
  svgstr: snapshotSvg
});

export const historyIcon = new LabIcon({
  name: 'infinijup:history',
  svgstr: historySvg
});

export const restoreIcon = new LabIcon({
  name: 'infinijup:restore',
  svgstr: restoreSvg
});

export const branchIcon = new LabIcon({
  name: 'infinijup:branch',
  svgstr: branchSvg
});
