"""Jupyter server configuration for the Infinijup UI tests (Galata).

Starts JupyterLab on port 8888 with the Galata test helpers, no token, in a
fresh temporary root directory, with the Infinijup server extension enabled.

Never use this configuration in production: it removes all security.
"""

import os
import shutil
import tempfile

from jupyterlab.galata import configure_jupyter_server

c = get_config()  # noqa: F821
configure_jupyter_server(c)

# The Infinijup server extension (REST API + events). If it cannot be loaded,
# jupyter_server only logs a warning; the @backend tests then fail on their
# first API call (they check GET /infinijup/status).
c.ServerApp.jpserver_extensions = {"infinijup": True}

# A snapshot store of its own, emptied each time the server starts, so the
# tests neither see nor leave commits in the user's store (the last run's stays
# for a look after a failure). INFINIJUP_UI_TESTS_STORE picks another place
# (emptied too).
_store = os.environ.get(
    "INFINIJUP_UI_TESTS_STORE",
    os.path.join(tempfile.gettempdir(), f"infinijup-ui-tests-store-{os.getuid()}"),
)
shutil.rmtree(_store, ignore_errors=True)
os.makedirs(_store, mode=0o700)
c.SnapshotManager.store_path = _store

# Quieter logs; keep warnings (an extension that fails to load shows up here).
c.ServerApp.log_level = "WARN"

# CI containers and this VM run as root.
c.ServerApp.allow_root = True
