"""An env's life on the host, apart from running it (:mod:`weenv.provision.runtime`).

- :mod:`._manager`: :class:`EnvManager`, the one facade over every env of the node: the env table,
  create (admission, then :mod:`._setup`), kill, exec/processes/files/ports proxied to the runtime,
  pause/resume, adoption after a daemon restart and gc, each concern handed to a part it builds:
- :mod:`._setup`: an env's parts on the host (layers, mounts, cgroup, bundle, network, container),
  set up, re-attached after a daemon restart, undone in any partial state;
- :mod:`._pool`: the warm pool (envs started ahead of time per lock);
- :mod:`._ttl`: TTL deadlines and expiry;
- :mod:`._commit`: commit, fork and snapshot removal (an env's upper sealed into a layer);
- :mod:`._gc`: the sweeps of gc (containers, cgroups, mounts, dirs, layer references of dead envs);
- :mod:`._ports`: TCP connections into an env's loopback;

- :mod:`._state`: the env record on disk (``envs/<id>/env.json``), ids and paths;
- :mod:`._mounts`: the upper tmpfs and the overlayfs rootfs over envlet lowers;
- :mod:`._trees`: hot layers kept as local trees (copied out of the envlet mount);
- :mod:`._snapshots`: snapshot records and snapshot trees (committed layers kept as directories);
- :mod:`._startcheck`: what is checked before an env starts (lock pins, registered layers, mounts);
- :mod:`._files`: file access into a running env's rootfs (no symlink escapes, sizes bounded) and the
  daemon API's file operations over it.
"""

from ._files import FileInfo as FileInfo
from ._files import RootFS as RootFS
from ._fileops import resolve_user as resolve_user
from ._manager import EnvManager as EnvManager
from ._snapshots import SnapshotNotFoundError as SnapshotNotFoundError
from ._snapshots import SnapshotRecord as SnapshotRecord
from ._snapshots import SnapshotStore as SnapshotStore
from ._startcheck import LockVerifier as LockVerifier
from ._state import EnvRecord as EnvRecord
from ._trees import LayerTrees as LayerTrees

__all__ = ["EnvManager", "EnvRecord", "FileInfo", "LayerTrees", "LockVerifier", "RootFS", "SnapshotNotFoundError", "SnapshotRecord",
           "SnapshotStore", "resolve_user"]
