"""Pytest wiring for the helper tests; the fixtures and tools live in helperkit.py (a unique
module name, so these tests never import another directory's ``conftest``)."""

from helperkit import client, helper, kernel, other_account, trees  # noqa: F401 - fixtures
