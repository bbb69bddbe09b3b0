"""Running an env: the runtime seam and what sits behind it.

- :mod:`._runtime`: the :class:`Runtime` interface the daemon drives, :class:`CrunRuntime` (crun)
  and the bundle (:func:`prepare_bundle`);
- :mod:`._ns`: the low-level helpers under crun: ctypes (setns, unshare, mount_setattr), fresh
  threads for namespace changes, the cgroup trampoline, killing an exec's process tree;
- :mod:`._gvisor`: :class:`GvisorRuntime` (runsc) and :class:`RuntimeRouter`, which sends each env
  to the runtime its plan asks for;
- :mod:`._ocispec`: the OCI ``config.json`` (capabilities, seccomp, mounts, users, ``/etc`` files);
- :mod:`._agent`: weenv-agent (``agent/weenv-agent.c``, built at daemon start) and the daemon's side
  of its protocol (exec, background processes, stdin, signals, reattach);
- :mod:`._idmap`: user namespaces (id ranges, trees made inert, the range's ownership);
- :mod:`._hostcheck`, :mod:`._criu`: what the host can do.
"""

from ._criu import criu_status as criu_status
from ._gvisor import GvisorRuntime as GvisorRuntime
from ._gvisor import RuntimeRouter as RuntimeRouter
from ._gvisor import node_runtime as node_runtime
from ._hostcheck import HostFacts as HostFacts
from ._hostcheck import detect_host as detect_host
from ._idmap import IdMap as IdMap
from ._ocispec import BindMount as BindMount
from ._ocispec import User as User
from ._ocispec import build_spec as build_spec
from ._runtime import ContainerState as ContainerState
from ._runtime import CrunRuntime as CrunRuntime
from ._runtime import ExecResult as ExecResult
from ._runtime import Runtime as Runtime
from ._runtime import prepare_bundle as prepare_bundle

__all__ = ["BindMount", "ContainerState", "CrunRuntime", "ExecResult", "GvisorRuntime", "HostFacts", "IdMap",
           "Runtime", "RuntimeRouter", "User", "build_spec", "criu_status", "detect_host", "node_runtime",
           "prepare_bundle"]
