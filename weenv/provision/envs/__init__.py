"""An env's life on the host, apart from running it (:mod:`weenv.provision.runtime`).

- :mod:`._manager`: :class:`EnvManager`, every env of the node: create (admission, layers, rootfs,
  cgroup, runtime), the warm pool, exec/processes/files/ports proxied to the runtime, TTLs,
  commit/fork, re-adoption after a daemon restart and gc;

- :mod:`._state`: the env record on disk (``envs/<id>/env.json``), ids and paths;
- :mod:`._mounts`: the upper tmpfs and the overlayfs rootfs over envlet lowers;
- :mod:`._trees`: hot layers kept as local trees (copied out of the envlet mount);
- :mod:`._snapshots`: commit/fork snapshots (an env's upper kept as layers);
- :mod:`._startcheck`: what is checked before an env starts (lock pins, registered layers, mounts);
- :mod:`._files`: file access into a running env's rootfs (no symlink escapes, sizes bounded).
"""

from ._files import FileInfo as FileInfo
from ._files import RootFS as RootFS
from ._files import resolve_user as resolve_user
from ._manager import EnvManager as EnvManager
from ._snapshots import SnapshotNotFoundError as SnapshotNotFoundError
from ._snapshots import SnapshotRecord as SnapshotRecord
from ._snapshots import SnapshotStore as SnapshotStore
from ._startcheck import LockVerifier as LockVerifier
from ._state import EnvRecord as EnvRecord
from ._trees import LayerTrees as LayerTrees

__all__ = ["EnvManager", "EnvRecord", "FileInfo", "LayerTrees", "LockVerifier", "RootFS", "SnapshotNotFoundError", "SnapshotRecord",
           "SnapshotStore", "resolve_user"]
