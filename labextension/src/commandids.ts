/** Command ids of the extension. */
export namespace CommandIDs {
  export const snapshot = 'infinijup:snapshot';
  export const restore = 'infinijup:restore';
  export const branch = 'infinijup:branch';
  export const resume = 'infinijup:resume';
  export const openInNewNotebook = 'infinijup:open-in-new-notebook';
  export const copyId = 'infinijup:copy-id';
  export const showHistory = 'infinijup:show-history';
  export const refresh = 'infinijup:refresh-history';
  export const toggleCollapse = 'infinijup:toggle-collapse';
  export const hibernate = 'infinijup:hibernate';
  export const undo = 'infinijup:undo';
  export const redo = 'infinijup:redo';
}
