"""The Jupyter server extension: /infinijup/* routes and progress events."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from .. import config
from ..engine import store_pages
from ..kernel_magics import autosnap
from . import aside
from .handlers import setup_handlers
from .manager import EVENT_SCHEMA_ID, SnapshotManager
from .websocket import RestingKernelConnection

SCHEMA = Path(__file__).parent / "event_schemas" / "operation-v1.yaml"


def _load_jupyter_server_extension(serverapp) -> None:  # noqa: ANN001 - jupyter_server's type
    manager = SnapshotManager(parent=serverapp, serverapp=serverapp, log=serverapp.log)
    serverapp.web_app.settings["infinijup_manager"] = manager
    if EVENT_SCHEMA_ID not in serverapp.event_logger.schemas.schema_ids:
        serverapp.event_logger.register_event_schema(SCHEMA)
    # Kernels inherit the server's environment: this is how %snapshot finds its way back. Not
    # the token: kernels sign their requests with their message key (kernel_auth.py).
    os.environ[config.SERVER_URL_ENV] = serverapp.connection_url
    os.environ.setdefault(config.RESULTS_DIR_ENV, str(config.results_dir()))
    # and their automatic snapshots' settings (kernel_magics/autosnap.py)
    os.environ[autosnap.ENV] = (f"{'on' if manager.autosnapshot else 'off'},"
                                f"share={manager.autosnapshot_share},"
                                f"after={manager.autosnapshot_after_s}")
    # Requests to a resting kernel wait in its websocket and wake it (hibernation.py).
    serverapp.web_app.settings["kernel_websocket_connection_class"] = RestingKernelConnection
    stop_kernels = serverapp.cleanup_kernels

    async def cleanup_kernels() -> None:  # a stopping server keeps hibernated kernels' records
        manager.hibernation.stopping = True
        if manager.hibernate_on_shutdown:
            await manager.hibernation.hibernate_all()
        await aside.end_all_kept(manager)  # kernels restores replaced, kept until settled
        await stop_kernels()
        await manager.remote_tier.stop(manager.remote_shutdown_wait)  # queued pushes go first
        store_pages.stop_spare()

    serverapp.cleanup_kernels = cleanup_kernels
    if manager.hibernate_on_shutdown and not (sys.stdin and sys.stdin.isatty()) and \
            threading.current_thread() is threading.main_thread():
        # Without a terminal, jupyter_server leaves SIGINT to Python: KeyboardInterrupt ends
        # the loop without cleanup_kernels (no hibernation, kernels left running). JupyterHub's
        # LocalProcessSpawner stops servers with SIGINT: stop cleanly, as on SIGTERM.
        signal.signal(signal.SIGINT, serverapp._signal_stop)
    manager.hibernation.start(manager.idle_check_interval)
    if manager.lazy_restore:  # the first restore from the store finds its serving process up
        store_pages.start_spare()
    setup_handlers(serverapp.web_app)
    serverapp.log.info("Infinijup server extension loaded (store: %s)", manager.store_path)


# jupyter_server < 2 name
load_jupyter_server_extension = _load_jupyter_server_extension
