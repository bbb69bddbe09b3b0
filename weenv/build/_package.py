"""``weenv package``: a repository at a commit becomes a thin ``task`` group over shared base groups.

    weenv package ./repo --base base.lock.toml --ref REG/tasks:t1 --commit SHA --setup 'make deps'

1. The tree at the commit is exported from git (``git archive``; with ``include_git`` a clone
   checked out at the commit), optionally without the files the commit's ``.gitignore`` rules
   match, and built on the host into a *source* layer at ``workdir`` whose parent directories
   carry the base's own attributes (as an overlay copy-up would).
2. The setup commands run as RUN steps of ``weenv build`` (same runner, same step cache) in envs
   started from the base lock plus the source layer, in ``workdir``, so what they install lands in
   the env's upper.
3. The source layer and the setup uppers are squashed into one layer, the ``task`` group. It is
   kept in the embedded store (so a later publish needs no rebuild) and published to REF; a task
   lock (base groups + task group) is written.

The package key covers the base lock's pinned layers and settings, the git tree (and the commit
with ``include_git``), the options and the setup commands. An unchanged task is not rebuilt, and
its publish sends only the blobs the target lacks: nothing when it was published before.

Errors::

    WeenvError
     └── BuildError                 (weenv.build._build)
          └── PackageError          a task cannot be packaged: repository, commit, dirty tree,
               │                    setup command, base, lock check
               └── TasksFileError   a tasks file line is malformed (names FILE:LINE)
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from .. import __version__, _home, layerfmt
from .._atomic import atomic_writer
from .._client import Client, WeenvError
from ._build import (
    BuildError,
    Step,
    StepCache,
    StepFailedError,
    _sha,
    base_key,
    locked_group,
    run_steps,
    squash_layers,
    tmp_dir,
)
from ._git import GitSource, export_tree, open_source
from ._package_errors import PackageError

DEFAULT_WORKDIR = "/repo"
DEFAULT_SETUP_TIMEOUT_S = 1800.0
LOCAL_SOURCE_REPO = "weenv-package/src"  # embedded-store repos that keep source and task layers
LOCAL_TASK_REPO = "weenv-package/task"
TASK_ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$"  # an OCI tag: ids go into refs
_NAME_BAD = re.compile(r"[^a-z0-9-]+")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

Stage = Callable[[str], Any]
"""``on_stage(text)``: what a task is doing now ("export", "setup 2/3", "publish", …)."""


def _load_base(base: Any) -> Any:
    """A plan lock from a path (a plan is locked now) or a Lock object."""
    from ..plan import Lock, PlanError, load_any, lock_plan
    from ..registry import RegistryError, resolve_group

    if isinstance(base, Lock):
        return base
    try:
        plan = load_any(str(base))
        return plan if isinstance(plan, Lock) else lock_plan(plan, resolve_group)
    except (PlanError, RegistryError, OSError) as e:
        raise PackageError(f"base {base}: {e}") from None


_parent_cache: dict[tuple[Any, ...], dict[str, tuple[int, int, int, int]]] = {}
_parent_cache_lock = threading.Lock()


def _base_dir_attrs(base_lock: Any, paths: list[str]) -> dict[str, tuple[int, int, int, int]]:
    """(mode, uid, gid, mtime) of each directory in ``paths`` from the topmost base group holding it.

    Read from the groups' TOCs (a tail Range read each), once per base and path list.
    """
    from ..registry import RegistryError, open_layer_ref

    key = (tuple(g.layer_digest for g in base_lock.groups), tuple(paths))
    with _parent_cache_lock:
        if key in _parent_cache:
            return _parent_cache[key]
    found: dict[str, tuple[int, int, int, int]] = {}
    for g in reversed(base_lock.groups):
        if len(found) == len(paths):
            break
        try:
            with open_layer_ref(g.pinned_ref) as reader:
                lay = layerfmt.Layer.open(reader)
                for p in paths:
                    if p in found or p not in lay:
                        continue
                    e = lay.entry(p)
                    if e.type != "dir":
                        shown = "/" if p == "." else "/" + p
                        raise PackageError(f"the workdir's parent {shown} is a {e.type} in base group {g.name!r}: "
                                           "choose a workdir whose parents are directories")
                    found[p] = (e.mode & 0o7777, e.uid, e.gid, e.mtime)
        except (RegistryError, layerfmt.LayerError) as e:
            raise PackageError(f"cannot read base group {g.name!r} ({g.pinned_ref}): {e}") from None
    with _parent_cache_lock:
        _parent_cache[key] = found
    return found


def _source_layer(src: GitSource, base_lock: Any, *, workdir: str, include_git: bool, gitignore: bool,
                  chown: tuple[int, int] | None, on_stage: Stage) -> Any:
    """Export the tree, build it into a layer at ``workdir`` and keep it in the embedded store.

    Returns the :class:`~weenv.plan.LockedGroup` of the source layer. A tree already built with the
    same options and base is reused.
    """
    from ..registry import NotFoundError, publish_layer_file, resolve_group

    parts = [p for p in workdir.strip("/").split("/") if p]
    parents = ["."] + ["/".join(parts[:i]) for i in range(1, len(parts))]
    attrs = _base_dir_attrs(base_lock, parents)
    src_key = _sha("package-src", layerfmt.FORMAT_VERSION, src.tree, src.commit if include_git else None,
                   gitignore, workdir, chown, sorted(attrs.items()))
    local_ref = f"{LOCAL_SOURCE_REPO}:{src_key[:40]}"
    try:
        if not include_git:  # a checkout with .git is not byte-stable: rebuild it each time
            info = resolve_group(local_ref)
            return _group_from_info(info, local_ref)
    except NotFoundError:
        pass
    on_stage("export")
    with tempfile.TemporaryDirectory(prefix="weenv-package-", dir=tmp_dir()) as tmp:
        root = os.path.join(tmp, "root")
        dest = os.path.join(root, *parts)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        export_tree(src, dest, include_git=include_git, gitignore=gitignore)
        if chown is not None:
            for dirpath, dirnames, filenames in os.walk(dest):
                for n in dirnames + filenames:
                    os.lchown(os.path.join(dirpath, n), *chown)
        uid, gid = chown or (0, 0)
        os.chown(dest, uid, gid)
        os.chmod(dest, 0o755)
        os.utime(dest, (src.commit_time, src.commit_time))
        for p in reversed(parents):  # deepest first: setting a child's times does not touch them again
            d = root if p == "." else os.path.join(root, p)
            mode, puid, pgid, mtime = attrs.get(p, (0o755, 0, 0, src.commit_time))
            os.chown(d, puid, pgid)
            os.chmod(d, mode)
            os.utime(d, (mtime, mtime))
        on_stage("build source layer")
        out = os.path.join(tmp, "src.weenv")
        with open(out, "wb") as f:
            built = layerfmt.build_layer(root, f)
        pub = publish_layer_file(out, local_ref, group="task", group_class="task", digest=built.digest,
                                 source=src.origin)
    return locked_group(pub, name="task", group_class="task")


def _group_from_info(info: Any, ref: str) -> Any:
    from ..plan import LockedGroup

    return LockedGroup(name="task", ref=ref, group_class="task", digest=info.manifest_digest,
                       layer_digest=info.layer_digest, layer_size=info.layer_size, toc_digest=info.toc_digest,
                       registry=info.registry, repo=info.repo)


# =============================================================================== package


@dataclass
class PackageResult:
    ref: str
    digest: str  # manifest digest of the task group
    lock: str  # path of the task lock
    uploaded_bytes: int  # blob bytes sent to REF's store (0: it had them all)
    toc_digest: str
    layer_digest: str
    layer_size: int
    commit: str
    tree: str
    cached: bool  # the task layer came from the package cache (no export, no setup)
    seconds: float
    manifest_pushed: bool = True
    steps: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _package_cache_path(key: str) -> str:
    return os.path.join(_home.home(), "cache", "package", "tasks", key + ".json")


def _cache_get(key: str) -> dict[str, Any] | None:
    from ..registry import LayoutStore

    try:
        with open(_package_cache_path(key), encoding="utf-8") as f:
            hit = json.load(f)
        path = LayoutStore(_home.store_dir()).blob_path(hit["layer_digest"])
        return hit if os.path.exists(path) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cache_put(key: str, entry: dict[str, Any]) -> None:
    path = _package_cache_path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_writer(path, mode=None, fsync=False, encoding="utf-8") as f:
            json.dump(entry, f)
    except OSError:
        pass  # the cache only saves time


_publish_locks: dict[tuple[str | None, str, str], threading.Lock] = {}
_publish_locks_guard = threading.Lock()
# docker-registry writes a repository's blob link files in place: a manifest PUT racing another
# upload of the same blob (or of the shared empty config) may find it "unknown" for a moment.
_RACY_REFUSALS = ("BLOB_UNKNOWN", "DIGEST_INVALID")
PUBLISH_ATTEMPTS = 4


def _publish(blob: str, ref: str, *, digest: str, source: str, annotations: dict[str, str]) -> Any:
    """Publish the task layer to ``ref``; same-blob publishes of this process go one at a time, and a
    refusal caused by a concurrent push elsewhere is retried."""
    import random

    from ..registry import RegistryError, parse_ref, publish_layer_file

    r = parse_ref(ref)
    with _publish_locks_guard:
        lock = _publish_locks.setdefault((r.registry, r.repo, digest), threading.Lock())
    for attempt in range(PUBLISH_ATTEMPTS):
        try:
            with lock:
                return publish_layer_file(blob, ref, group="task", group_class="task", digest=digest, source=source,
                                          annotations=annotations)
        except RegistryError as e:
            if attempt + 1 < PUBLISH_ATTEMPTS and any(code in str(e) for code in _RACY_REFUSALS):
                time.sleep(0.2 * 2**attempt * (0.5 + random.random()))
                continue
            raise PackageError(f"cannot publish {ref}: {e}") from None
    raise AssertionError("unreachable")


def plan_name(text: str) -> str:
    """A plan name (lowercase DNS label) made from a task id, tag or directory name."""
    name = _NAME_BAD.sub("-", text.lower()).strip("-")[:63].strip("-")
    return name or "task"


def _default_name(ref: str, repo: str) -> str:
    from ..registry import parse_ref

    r = parse_ref(ref)
    return plan_name(r.tag if r.tag and r.tag != "latest" else os.path.basename(repo.rstrip("/")) or r.repo)


def package(repo: str, *, base: Any, ref: str, commit: str | None = None, setup: list[str] | tuple[str, ...] = (),
            workdir: str = DEFAULT_WORKDIR, env: dict[str, str] | None = None, gitignore: bool = False,
            include_git: bool = False, chown: tuple[int, int] | None = None, lock_out: str | None = None,
            name: str | None = None, setup_timeout_s: float | None = DEFAULT_SETUP_TIMEOUT_S,
            keep_snapshots: bool = False, base_dir: str | None = None, client: Client | None = None,
            on_stage: Stage | None = None, network: str | None = None) -> PackageResult:
    """Package ``repo`` at ``commit`` with ``setup`` over ``base`` (a plan/lock path or a Lock) as
    the ``task`` group ``ref``; write the task lock to ``lock_out`` (default ``./NAME.lock.toml``).

    The setup snapshots are deleted once the task group is published unless ``keep_snapshots``
    (keep them to iterate on the setup commands with the step cache).
    """
    from ..plan import write_plan
    from ..registry import RegistryError, parse_ref

    t0 = time.perf_counter()
    stage = on_stage or (lambda text: None)
    if not workdir.startswith("/") or "\0" in workdir or ".." in workdir.split("/") or workdir.strip("/") == "":
        raise PackageError(f"workdir must be an absolute path below / without '..', got {workdir!r}")
    workdir = "/" + "/".join(p for p in workdir.split("/") if p)
    try:
        target = parse_ref(ref)
    except RegistryError as e:
        raise PackageError(str(e)) from None
    if target.tag is None:
        raise PackageError(f"--ref {ref!r} needs a tag: the task group is published by tag")
    stage("resolve")
    base_lock = _load_base(base)
    src = open_source(repo, commit, base_dir=base_dir)
    name = plan_name(name) if name else _default_name(ref, repo)
    env = dict(env or {})
    bad = [k for k in env if not _ENV_NAME.match(k)]
    if bad:
        raise PackageError(f"environment variable names must be letters, digits and '_' (not starting with a "
                           f"digit): {', '.join(map(repr, bad))}")
    setup = list(setup)
    warnings = []
    if target.registry is not None:
        local = [g.name for g in base_lock.groups if g.registry is None]
        if local:
            warnings.append(f"base groups {', '.join(local)} live in this node's embedded store: the task lock "
                            f"works only here; publish them to {target.registry} and lock the base against it")
    key = _sha("package", __version__, layerfmt.FORMAT_VERSION, base_key(base_lock), base_lock.env, base_lock.workdir,
               base_lock.user, src.tree, src.commit if include_git else None, gitignore, include_git, workdir, chown,
               setup, env, *([network] if network else []))
    lock_path = os.path.abspath(lock_out or f"{name}.lock.toml")
    steps: list[dict[str, Any]] = []
    created: list[str] = []
    own_client = client is None
    c = client
    try:
        hit = _cache_get(key)
        cached = hit is not None
        if hit is None:
            try:
                src_group = _source_layer(src, base_lock, workdir=workdir, include_git=include_git,
                                          gitignore=gitignore, chown=chown, on_stage=stage)
                digests = [src_group.layer_digest]
                if setup:
                    if c is None:
                        c = Client(timeout_s=(setup_timeout_s or 24 * 3600.0) + 120.0)
                    digests += _run_setup(c, base_lock, src_group, name=name, setup=setup, env=env,
                                          workdir=workdir, timeout_s=setup_timeout_s, steps=steps, created=created,
                                          on_stage=stage, network=network)
                stage("squash")
                hit = _seal(digests, src_group, origin=src.origin)
            except (RegistryError, layerfmt.LayerError) as e:
                raise PackageError(f"{src.origin}: {e}") from None
            except OSError as e:
                raise PackageError(f"{src.origin}: {e.strerror or e}: {e.filename or ''}") from None
            _cache_put(key, hit)
        stage("publish")
        from ..registry import LayoutStore

        blob = LayoutStore(_home.store_dir()).blob_path(hit["layer_digest"])
        ann = {"dev.weenv.package.commit": src.commit, "dev.weenv.package.tree": src.tree}
        pub = _publish(blob, ref, digest=hit["layer_digest"], source=src.origin, annotations=ann)
        task_group = locked_group(pub, name="task", group_class="task")
        lock = msgspec.structs.replace(base_lock, name=name,
                                       groups=[g for g in base_lock.groups if g.name != "task"] + [task_group],
                                       env={**base_lock.env, **env}, workdir=workdir)
        os.makedirs(os.path.dirname(lock_path), exist_ok=True)
        write_plan(lock, lock_path)
        if created and not keep_snapshots and c is not None:
            for snap in created:
                try:
                    c.delete_snapshot(snap)
                except WeenvError:
                    pass  # a snapshot another build still uses; gc of the step cache is best effort
        return PackageResult(ref=str(target), digest=pub.digest, lock=lock_path, uploaded_bytes=pub.uploaded_bytes,
                             toc_digest=pub.toc_digest, layer_digest=pub.layer_digest, layer_size=pub.size,
                             commit=src.commit, tree=src.tree, cached=cached, seconds=time.perf_counter() - t0,
                             manifest_pushed=pub.manifest_pushed, steps=steps, warnings=warnings)
    finally:
        if own_client and c is not None:
            c.close()


def _run_setup(c: Client, base_lock: Any, src_group: Any, *, name: str, setup: list[str], env: dict[str, str],
               workdir: str, timeout_s: float | None, steps: list[dict[str, Any]], created: list[str],
               on_stage: Stage, network: str | None = None) -> list[str]:
    """Run the setup commands over base + source; the digests of the uppers they left, bottom first."""
    start_lock = msgspec.structs.replace(base_lock, name=name,
                                         groups=[g for g in base_lock.groups if g.name != "task"] + [src_group])
    program = ([Step(env=env)] if env else []) + [Step(workdir=workdir)]
    first_run = len(program)
    program += [Step(run=cmd, timeout_s=timeout_s) for cmd in setup]

    def label(i: int, step: Step) -> str:
        return f"setup command {i - first_run + 1} ({step.run!r})"

    def on_step(i: int, step: Step) -> None:
        if step.run is not None:
            on_stage(f"setup {i - first_run + 1}/{len(setup)}")

    try:
        done = run_steps(c, program, start=msgspec.to_builtins(start_lock), key=_sha("package-from", base_key(start_lock)),
                         cache=StepCache(), label=label, on_step=on_step, network=network)
    except StepFailedError as e:
        raise PackageError(str(e)) from e
    except BuildError:
        raise
    except WeenvError as e:
        raise PackageError(f"setup env over {src_group.ref}: {e}") from e
    for s in done.steps:
        if s.kind == "run":
            steps.append({"command": setup[s.index - first_run], "cached": s.cached, "seconds": round(s.seconds, 3),
                          "snapshot": s.snapshot})
    created.extend(done.created_snapshots)
    assert done.snapshot is not None
    return [x["digest"] for x in c.snapshot(done.snapshot).layers]


def _seal(digests: list[str], src_group: Any, *, origin: str) -> dict[str, Any]:
    """Squash the layers into the task layer, keep it (tagged) in the embedded store; its cache entry."""
    from ..registry import LayoutStore, publish_layer_file

    if len(digests) == 1:  # no setup: the source layer is the task layer
        return {"layer_digest": src_group.layer_digest, "toc_digest": src_group.toc_digest,
                "size": src_group.layer_size}
    store = LayoutStore(_home.store_dir())
    with tempfile.TemporaryDirectory(prefix="weenv-package-", dir=tmp_dir()) as tmp:
        out = os.path.join(tmp, "task.weenv")
        digest = squash_layers(digests, out, tmp)
        pub = publish_layer_file(out, f"{LOCAL_TASK_REPO}:{digest[7:47]}", group="task", group_class="task",
                                 digest=digest, source=origin, store=store)
    return {"layer_digest": pub.layer_digest, "toc_digest": pub.toc_digest, "size": pub.size}


