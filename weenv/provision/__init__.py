"""Provisioning: plans composed into overlayfs rootfs run as isolated containers, sized by cgroups.

- :mod:`._daemon`: the daemon (``weenv daemon``), which builds the parts below in one step and runs them;
- :mod:`.server`: its HTTP server and the routes of its API (the E2B API, :mod:`weenv.api`, sits beside);
- :mod:`.envs`: the envs: :class:`EnvManager` (create, warm pool, exec/files, TTL, commit/fork, gc)
  and an env on disk (record, mounts, layer trees, snapshots, start checks, file access);
- :mod:`.runtime`: running it (the runtime seam, crun, gVisor, OCI spec, weenv-agent, user namespaces);
- :mod:`.elastic`: resizing it (policy, monitor, prometheus rendering);
- :mod:`.cgroups`: the cgroup backends (v1, v2).
"""

from ._daemon import Daemon as Daemon
from ._daemon import DaemonConfig as DaemonConfig
from ._daemon import serve as serve
from ._errors import AdmissionError as AdmissionError
from ._errors import CgroupBusyError as CgroupBusyError
from ._errors import CgroupError as CgroupError
from ._errors import CgroupExistsError as CgroupExistsError
from ._errors import CgroupNameError as CgroupNameError
from ._errors import CgroupNotFoundError as CgroupNotFoundError
from ._errors import CgroupUnavailableError as CgroupUnavailableError
from ._errors import ContainerError as ContainerError
from ._errors import ContainerExistsError as ContainerExistsError
from ._errors import ContainerNotFoundError as ContainerNotFoundError
from ._errors import EnvError as EnvError
from ._errors import EnvFileError as EnvFileError
from ._errors import EnvFileNotFoundError as EnvFileNotFoundError
from ._errors import EnvFileTooLargeError as EnvFileTooLargeError
from ._errors import EnvFileTypeError as EnvFileTypeError
from ._errors import EnvNotFoundError as EnvNotFoundError
from ._errors import EnvStartError as EnvStartError
from ._errors import EnvStateError as EnvStateError
from ._errors import HostError as HostError
from ._errors import MountError as MountError
from ._errors import ProvisionError as ProvisionError
from ._errors import SpecError as SpecError
from ._errors import UserNotFoundError as UserNotFoundError
from .cgroups import Cgroup as Cgroup
from .cgroups import CgroupBackend as CgroupBackend
from .cgroups import CgroupSample as CgroupSample
from .cgroups import V1Backend as V1Backend
from .cgroups import V2Backend as V2Backend
from .cgroups import detect_backend as detect_backend
from .elastic import Admission as Admission
from .elastic import DEFAULT_POLICY as DEFAULT_POLICY
from .elastic import Decision as Decision
from .elastic import EnvLimits as EnvLimits
from .elastic import EnvMetrics as EnvMetrics
from .elastic import EnvQuotaState as EnvQuotaState
from .elastic import Monitor as Monitor
from .elastic import MonitorStatistics as MonitorStatistics
from .elastic import NodeView as NodeView
from .elastic import PolicyConfig as PolicyConfig
from .elastic import admit as admit
from .elastic import decide as decide
from .envs import EnvManager as EnvManager
from .envs import FileInfo as FileInfo
from .envs import RootFS as RootFS
from .envs import resolve_user as resolve_user
from .runtime import BindMount as BindMount
from .runtime import ContainerState as ContainerState
from .runtime import CrunRuntime as CrunRuntime
from .runtime import ExecResult as ExecResult
from .runtime import HostFacts as HostFacts
from .runtime import Runtime as Runtime
from .runtime import User as User
from .runtime import build_spec as build_spec
from .runtime import criu_status as criu_status
from .runtime import detect_host as detect_host
from .runtime import prepare_bundle as prepare_bundle

__all__ = ["Admission", "AdmissionError", "BindMount", "Cgroup", "CgroupBackend", "CgroupBusyError", "CgroupError",
           "CgroupExistsError", "CgroupNameError", "CgroupNotFoundError", "CgroupSample", "CgroupUnavailableError",
           "ContainerError", "ContainerExistsError", "ContainerNotFoundError", "ContainerState", "CrunRuntime",
           "DEFAULT_POLICY", "Daemon", "DaemonConfig", "Decision", "EnvError", "EnvFileError", "EnvFileNotFoundError",
           "EnvFileTooLargeError", "EnvFileTypeError", "EnvLimits", "EnvManager", "EnvMetrics", "EnvNotFoundError",
           "EnvQuotaState", "EnvStartError", "EnvStateError", "ExecResult", "FileInfo", "HostError", "HostFacts",
           "Monitor", "MonitorStatistics", "MountError", "NodeView", "PolicyConfig", "ProvisionError", "RootFS",
           "Runtime", "SpecError", "User", "UserNotFoundError", "V1Backend", "V2Backend", "admit", "build_spec",
           "criu_status", "decide", "detect_backend", "detect_host", "prepare_bundle", "resolve_user", "serve"]
