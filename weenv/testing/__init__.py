"""Harness code shared by tests/ and benchmarks/ (and the fixture cache `weenv demo` looks into).

- fakes of the seams, for unit tests of logic: :class:`FakeRuntime` (containers in memory),
  :class:`FakeBackend` (cgroups with a workload model driven by a clock), :class:`FakeStore` (an
  OCI store in memory), :class:`FakeChunkTier` (an envlet chunk tier in memory), :class:`ScriptedDaemon`
  (a daemon client answering from a script, behind the API server in its unit tests);
- real parts started privately: a weenv daemon (:class:`DaemonHandle`, :func:`busybox_plan`,
  :func:`teardown_private_daemon`; one egressing into a test-made network namespace,
  :func:`egress_daemon` with :class:`Outside`), a private dockerd (:func:`start_dockerd`), a
  docker-registry with fault-injecting proxies
  (:func:`start_registry`, :func:`start_proxy`), a fake SGLang server and slime's ``Sample``
  (:class:`FakeSGLang`, :class:`Sample`);
- fixtures built once and cached outside the clone (:func:`cached`, :func:`debian_tar`,
  :func:`busybox_tree`, :func:`rollout_binary`), and the escape probe run inside envs
  (:data:`PROBE_SOURCE`, :func:`attempts`).

pytest is not needed to import it: a missing host tool raises :class:`HostUnsupported`, which
pytest reports as a skip.
"""

from ._api import ScriptedDaemon as ScriptedDaemon
from ._cgroups import FakeBackend as FakeBackend
from ._cgroups import FakeCgroup as FakeCgroup
from ._daemon import DaemonHandle as DaemonHandle
from ._docker import Dockerd as Dockerd
from ._docker import start_dockerd as start_dockerd
from ._docker import stop_dockerd as stop_dockerd
from ._daemon import busybox_plan as busybox_plan
from ._daemon import leftovers as leftovers
from ._daemon import teardown_private_daemon as teardown_private_daemon
from ._daemon import wait_for as wait_for
from ._escape import DOORS_SOURCE as DOORS_SOURCE
from ._escape import PROBE_SOURCE as PROBE_SOURCE
from ._escape import SHIPPED_DEVICES as SHIPPED_DEVICES
from ._escape import attempts as attempts
from ._escape import device_plan as device_plan
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
from ._host import HostUnsupported as HostUnsupported
from ._host import require_fuse as require_fuse
from ._host import require_root as require_root
from ._host import require_tool as require_tool
from ._images import busybox_tree as busybox_tree
from ._images import check_debian_tar as check_debian_tar
from ._images import debian_tar as debian_tar
from ._images import debian_tar_name as debian_tar_name
from ._images import extracted as extracted
from ._images import source_tree as source_tree
from ._network import OUTSIDE_A as OUTSIDE_A
from ._network import OUTSIDE_B as OUTSIDE_B
from ._network import OUTSIDE_BIG_BYTES as OUTSIDE_BIG_BYTES
from ._network import OUTSIDE_HOST as OUTSIDE_HOST
from ._network import OUTSIDE_NAMES as OUTSIDE_NAMES
from ._network import OUTSIDE_OTHER_PORT as OUTSIDE_OTHER_PORT
from ._network import OUTSIDE_PORT as OUTSIDE_PORT
from ._network import EgressDaemon as EgressDaemon
from ._network import Outside as Outside
from ._network import egress_daemon as egress_daemon
from ._network import weenv_links as weenv_links
from ._registry import Fault as Fault
from ._registry import Proxy as Proxy
from ._registry import ProxyLog as ProxyLog
from ._registry import RegistryProcess as RegistryProcess
from ._registry import start_proxy as start_proxy
from ._registry import start_registry as start_registry
from ._registry import stop_proxy as stop_proxy
from ._registry import stop_registry as stop_registry
from ._rollout import parse_rollout_result as parse_rollout_result
from ._rollout import rollout_binary as rollout_binary
from ._runtime import FakeCommand as FakeCommand
from ._runtime import FakeRuntime as FakeRuntime
from ._store import FakeStore as FakeStore
from ._chunktier import FakeChunkTier as FakeChunkTier
from ._slime import ByteTokenizer as ByteTokenizer
from ._slime import FakeSGLang as FakeSGLang
from ._slime import LegacySample as LegacySample
from ._slime import Reply as Reply
from ._slime import Sample as Sample
from ._slime import byte_tokenizer as byte_tokenizer
from ._slime import sampling_params as sampling_params
from ._slime import slime_args as slime_args
from ._slime import train_side_checks as train_side_checks
from ._slime import turns as turns

__all__ = ["BadEntry", "BuildError", "ByteTokenizer", "DEFAULT_ROOT", "DOORS_SOURCE", "DaemonHandle", "Dockerd", "ENV_VAR", "EgressDaemon",
           "FakeBackend", "FakeCgroup", "FakeChunkTier", "FakeCommand", "FakeRuntime", "FakeSGLang", "FakeStore",
           "Fault",
           "FixtureCacheError", "HostUnsupported", "LegacySample", "OUTSIDE_A", "OUTSIDE_B", "OUTSIDE_BIG_BYTES",
           "OUTSIDE_HOST", "OUTSIDE_NAMES", "OUTSIDE_OTHER_PORT", "OUTSIDE_PORT", "Outside", "PROBE_SOURCE", "Proxy",
           "ProxyLog", "RegistryProcess", "Reply", "SHIPPED_DEVICES", "Sample", "ScriptedDaemon", "attempts", "busybox_plan", "busybox_tree",
           "byte_tokenizer", "cache_root", "cached", "check_debian_tar", "check_executable", "check_file", "check_tar",
           "check_tree", "debian_tar", "debian_tar_name", "device_plan", "egress_daemon", "extracted", "find", "leftovers",
           "parse_rollout_result", "require_fuse", "require_root", "require_tool", "rollout_binary", "sampling_params",
           "slime_args", "source_tree", "start_dockerd", "start_proxy", "start_registry", "stop_dockerd", "stop_proxy", "stop_registry",
           "teardown_private_daemon", "train_side_checks", "turns", "wait_for", "weenv_links"]
