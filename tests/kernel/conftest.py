"""Pytest wiring for the kernel tests; fixtures and tools live in kernelkit.py."""

from kernelkit import (  # noqa: F401 - fixtures, found by name
    Notebook,
    helper_daemon,
    infinijup_kernelspec,
    jp_server_config,
    needs_helper,
    notebook,
    operation_events,
)
