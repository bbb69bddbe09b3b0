"""Harness code shared by tests/ and benchmarks/ (and the fixture cache `weenv demo` looks into)."""

from ._cgroups import FakeBackend as FakeBackend
from ._cgroups import FakeCgroup as FakeCgroup
from ._fixturecache import DEFAULT_ROOT as DEFAULT_ROOT
from ._fixturecache import ENV_VAR as ENV_VAR
from ._fixturecache import BadEntry as BadEntry
from ._fixturecache import BuildError as BuildError
from ._fixturecache import FixtureCacheError as FixtureCacheError
from ._fixturecache import cache_root as cache_root
from ._fixturecache import cached as cached
from ._fixturecache import check_executable as check_executable
from ._fixturecache import check_file as check_file
from ._fixturecache import check_tar as check_tar
from ._fixturecache import check_tree as check_tree
from ._fixturecache import find as find
from ._runtime import FakeCommand as FakeCommand
from ._runtime import FakeRuntime as FakeRuntime

__all__ = ["DEFAULT_ROOT", "ENV_VAR", "BadEntry", "BuildError", "FakeBackend", "FakeCgroup", "FakeCommand",
           "FakeRuntime", "FixtureCacheError", "cache_root", "cached", "check_executable", "check_file", "check_tar",
           "check_tree", "find"]
