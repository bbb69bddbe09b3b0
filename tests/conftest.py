"""Shared fixtures. Each area keeps its fixtures in tests/fixtures_<area>.py, loaded here."""

pytest_plugins = [
    "tests.fixtures_common",
    "tests.fixtures_envlet",
    "tests.fixtures_cgroups",
    "tests.fixtures_registry",
    "tests.fixtures_runtime",
    "tests.fixtures_slime",
    "tests.fixtures_daemon",
]
