"""Running an env: the runtime seam and what sits behind it.

- :mod:`._seam`: the interfaces: :class:`Containers` (create, start, kill, delete, state, list:
  what each runtime implements), :class:`Runtime` (that plus the env's processes, the type the
  daemon holds), optional capabilities (:class:`~._seam.Capability`);
- :mod:`._processes`: :class:`~._processes.ProcessHost`, the one process host of every runtime
  (exec and process handles, through the env's agent or the runtime's own exec);
- :mod:`._runtime`: :class:`CrunRuntime` (crun) and the bundle (:func:`prepare_bundle`), with
  :mod:`._spawn` (the sealed crun copy, posix_spawn of ``crun create``) and :mod:`._seccomp` (the
  seccomp program built once);
- :mod:`._gvisor`: :class:`GvisorRuntime` (runsc), with :mod:`._checkpoint` (its memory snapshots:
  runsc checkpoint and restore), :mod:`._runsc` (the platform probe, the
  spec runsc takes, its view of the rootfs);
- :mod:`._oci`: what crun and runsc share as parts (the command line, the table of their envs);
- :mod:`._router`: :class:`RuntimeRouter`, which sends each env to the runtime its plan asks for,
  and the daemon's :func:`node_runtime`;
- :mod:`._ns`: the low-level helpers under crun: ctypes (setns, unshare, mount_setattr), fresh
  threads for namespace changes, the cgroup trampoline, killing an exec's process tree;
- :mod:`._ocispec`: the OCI ``config.json`` (capabilities, seccomp, mounts, users, ``/etc`` files);
- :mod:`._agent`: weenv-agent (``agent/weenv-agent.c``, built at daemon start) and the daemon's side
  of its protocol (exec, background processes, stdin, signals, reattach);
- :mod:`._idmap`: user namespaces (id ranges, trees made inert, the range's ownership);
- :mod:`._hostcheck`, :mod:`._criu`: what the host can do.
"""

from ._criu import criu_status as criu_status
from ._gvisor import GvisorRuntime as GvisorRuntime
from ._hostcheck import HostFacts as HostFacts
from ._hostcheck import detect_host as detect_host
from ._idmap import IdMap as IdMap
from ._ocispec import BindMount as BindMount
from ._ocispec import User as User
from ._ocispec import build_spec as build_spec
from ._router import RuntimeRouter as RuntimeRouter
from ._router import node_runtime as node_runtime
from ._runtime import CrunRuntime as CrunRuntime
from ._runtime import prepare_bundle as prepare_bundle
from ._seam import ContainerState as ContainerState
from ._seam import ExecResult as ExecResult
from ._seam import Runtime as Runtime

__all__ = ["BindMount", "ContainerState", "CrunRuntime", "ExecResult", "GvisorRuntime", "HostFacts", "IdMap",
           "Runtime", "RuntimeRouter", "User", "build_spec", "criu_status", "detect_host", "node_runtime",
           "prepare_bundle"]
