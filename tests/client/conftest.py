"""Fixtures of tests/client: the SDK-level ones (tests/ems_fixtures.py)."""

from ems_fixtures import _isolated_ems, cc, faulty  # noqa: F401 (fixtures pytest finds by name)
