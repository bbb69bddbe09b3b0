"""Shared fixtures. Each area keeps its fixtures in tests/fixtures_<area>.py, loaded here."""

import os

# Tests start their daemons themselves (and stop them by PID): a client that finds no daemon must
# fail, not start an orphan one that outlives the test.
os.environ["WEENV_AUTOSTART"] = "0"

pytest_plugins = [
    "tests.fixtures_common",
    "tests.fixtures_envlet",
    "tests.fixtures_cgroups",
    "tests.fixtures_registry",
    "tests.fixtures_runtime",
    "tests.fixtures_slime",
    "tests.fixtures_daemon",
    "tests.fixtures_docker",
]
