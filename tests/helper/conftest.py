"""Pytest wiring for the helper tests; the fixtures and tools live in helperkit.py (a unique
module name, so these tests never import another directory's ``conftest``)."""

import pytest
from helperkit import HelperDaemon, client, helper, kernel, other_account, trees  # noqa: F401 - fixtures


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used the session helper shows that helper's log: CI prints only the
    test output, and the helper's side of a failure is often the part that says why."""
    outcome = yield
    report = outcome.get_result()
    daemon = getattr(item, "funcargs", {}).get("helper")
    if report.failed and isinstance(daemon, HelperDaemon):
        report.sections.append(("the helper's log, last 5000 characters", daemon.log()))
