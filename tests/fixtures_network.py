"""The "outside world" of egress tests: the ``outside`` fixture (module scope). The harness itself
(:class:`weenv.testing.Outside`, :func:`weenv.testing.egress_daemon`) is shared with the benchmarks;
the short names below are the ones the tests use.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from weenv.testing import OUTSIDE_A as OUT_A
from weenv.testing import OUTSIDE_B as OUT_B
from weenv.testing import OUTSIDE_BIG_BYTES as BIG_BYTES
from weenv.testing import OUTSIDE_HOST as OUT_HOST
from weenv.testing import OUTSIDE_NAMES as NAMES
from weenv.testing import OUTSIDE_OTHER_PORT as OTHER_PORT
from weenv.testing import OUTSIDE_PORT as PORT
from weenv.testing import EgressDaemon, Outside, egress_daemon, weenv_links


@pytest.fixture(scope="module")
def outside() -> Iterator[Outside]:
    if shutil.which("nft") is None:
        pytest.skip("nftables is not installed (apt-get install nftables)")
    world = Outside()
    try:
        world.open()
        yield world
    finally:
        world.close()


__all__ = ["BIG_BYTES", "NAMES", "OTHER_PORT", "OUT_A", "OUT_B", "OUT_HOST", "PORT", "EgressDaemon", "Outside",
           "egress_daemon", "outside", "weenv_links"]
