"""Jupyter server configuration for the Infinijup UI tests (Galata).

Starts JupyterLab with the Galata test helpers, no token, in a fresh temporary
root directory, with the Infinijup server extension enabled, on the port the
Playwright runner picked (INFINIJUP_UI_PORT; 8888 when run by hand). The run's
id (INFINIJUP_UI_RUN_ID) goes into ``infinijup-ui-run.txt`` at the root, so
the tests can tell their own server from a foreign one.

Never use this configuration in production: it removes all security.
"""

import glob
import os
import shutil
import tempfile
import time

from jupyterlab.galata import configure_jupyter_server

c = get_config()  # noqa: F821
configure_jupyter_server(c)

_port = int(os.environ.get("INFINIJUP_UI_PORT") or 8888)
c.ServerApp.port = _port
with open(os.path.join(c.ServerApp.root_dir, "infinijup-ui-run.txt"), "w") as f:
    f.write(os.environ.get("INFINIJUP_UI_RUN_ID", ""))

# The Infinijup server extension (REST API + events). If it cannot be loaded,
# jupyter_server only logs a warning; the @backend tests then fail on their
# first API call (they check GET /infinijup/status).
c.ServerApp.jpserver_extensions = {"infinijup": True}

# A snapshot store of its own (one per port, so runs side by side do not share
# one), emptied each time the server starts, so the tests neither see nor leave
# commits in the user's store (the last run's stays for a look after a
# failure; those older than a day go). INFINIJUP_UI_TESTS_STORE picks another
# place (emptied too).
_prefix = os.path.join(tempfile.gettempdir(), f"infinijup-ui-tests-store-{os.getuid()}-")
for _old in glob.glob(_prefix + "*"):
    if time.time() - os.path.getmtime(_old) > 86400:
        shutil.rmtree(_old, ignore_errors=True)
_store = os.environ.get("INFINIJUP_UI_TESTS_STORE", f"{_prefix}{_port}")
shutil.rmtree(_store, ignore_errors=True)
os.makedirs(_store, mode=0o700)
c.SnapshotManager.store_path = _store

# Quieter logs; keep warnings (an extension that fails to load shows up here).
c.ServerApp.log_level = "WARN"

# CI containers and this VM run as root.
c.ServerApp.allow_root = True
