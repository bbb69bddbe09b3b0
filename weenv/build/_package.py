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

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

import msgspec

from .. import __version__, _home, layerfmt
from .._atomic import atomic_writer
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
from .._client import Client, WeenvError

DEFAULT_WORKDIR = "/repo"
DEFAULT_SETUP_TIMEOUT_S = 1800.0
LOCAL_SOURCE_REPO = "weenv-package/src"  # embedded-store repos that keep source and task layers
LOCAL_TASK_REPO = "weenv-package/task"
TASK_ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$"  # an OCI tag: ids go into refs
_NAME_BAD = re.compile(r"[^a-z0-9-]+")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_URL = re.compile(r"^([a-z][a-z0-9+.-]*://|[A-Za-z0-9._-]+@[^:/\s]+:)")

Stage = Callable[[str], Any]
"""``on_stage(text)``: what a task is doing now ("export", "setup 2/3", "publish", …)."""


class PackageError(BuildError):
    """Raised when a task cannot be packaged; the message names the repository, commit or command."""


class TasksFileError(PackageError):
    """Raised for a malformed tasks file; the message starts with ``FILE:LINE:``."""


# =============================================================================== git


_GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}  # CI must fail on a private URL, not prompt


def _git(args: list[str], *, git_dir: str | None = None, cwd: str | None = None, input: bytes | None = None,
         ok_codes: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[bytes]:
    # safe.directory: repositories checked out by another user (CI checkouts, mounted volumes)
    cmd = ["git", "-c", "safe.directory=*"]
    if git_dir is not None:
        cmd += ["--git-dir", git_dir]
    cmd += args
    try:
        p = subprocess.run(cmd, cwd=cwd, input=input, capture_output=True, env={**os.environ, **_GIT_ENV})
    except FileNotFoundError:
        raise PackageError("git is not installed (weenv package needs the git command)") from None
    if p.returncode not in ok_codes:
        err = p.stderr.decode("utf-8", "replace").strip()
        raise subprocess.CalledProcessError(p.returncode, cmd, p.stdout, err)
    return p


def _git_out(args: list[str], **kw: Any) -> str:
    return _git(args, **kw).stdout.decode("utf-8", "replace").strip()


def _first_line(e: subprocess.CalledProcessError) -> str:
    text = e.stderr if isinstance(e.stderr, str) else (e.stderr or b"").decode("utf-8", "replace")
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else f"git exited with {e.returncode}"


def is_git_url(repo: str) -> bool:
    """``https://…``, ``ssh://…``, ``file://…`` or scp-like ``git@host:path``."""
    return bool(_URL.match(repo))


@dataclass(frozen=True)
class GitSource:
    """A repository resolved to one commit."""

    repo: str  # as given
    git_dir: str
    work_tree: str | None  # None for bare repositories and URL mirrors
    commit: str  # full hash
    tree: str  # the commit's tree hash: what the package key uses
    commit_time: int

    @property
    def origin(self) -> str:
        """``repo@commit`` for the group's source annotation."""
        return f"{self.repo}@{self.commit}"


_mirror_locks: dict[str, threading.Lock] = {}
_mirror_locks_guard = threading.Lock()


@contextmanager
def _mirror_lock(path: str) -> Iterator[None]:
    """One clone or fetch of a URL at a time, across threads (lock) and processes (flock)."""
    with _mirror_locks_guard:
        lock = _mirror_locks.setdefault(path, threading.Lock())
    with lock:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield


def _mirror(url: str) -> str:
    """A bare mirror of ``url`` under ``$WEENV_HOME/cache/package/git``, cloned on first use."""
    path = os.path.join(_home.home(), "cache", "package", "git", hashlib.sha256(url.encode()).hexdigest()[:24] + ".git")
    if os.path.isdir(path):
        return path
    with _mirror_lock(path):
        if os.path.isdir(path):
            return path
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _git(["clone", "--mirror", "--quiet", url, tmp])
        except subprocess.CalledProcessError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise PackageError(f"cannot clone {url}: {_first_line(e)}") from None
        os.replace(tmp, path)
    return path


def _fetch_mirror(url: str, path: str, commit: str | None) -> None:
    with _mirror_lock(path):
        try:
            _git(["fetch", "--quiet", "--prune", "origin"], git_dir=path)
        except subprocess.CalledProcessError as e:
            raise PackageError(f"cannot fetch {url}: {_first_line(e)}") from None
        if commit and re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", commit):
            try:  # a commit no branch or tag reaches; servers that allow it send it
                _git(["fetch", "--quiet", "origin", commit], git_dir=path)
            except subprocess.CalledProcessError:
                pass


def _resolve_commit(git_dir: str, commit: str) -> str | None:
    p = _git(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{commit}^{{commit}}"], git_dir=git_dir,
             ok_codes=(0, 1, 128))
    return p.stdout.decode().strip() if p.returncode == 0 else None


def open_source(repo: str, commit: str | None = None, *, base_dir: str | None = None) -> GitSource:
    """Resolve ``repo`` (a path, relative to ``base_dir``, or a git URL) and ``commit`` (default HEAD).

    Without ``commit`` a local work tree must be clean: uncommitted changes would silently be left
    out of the package. Raises :class:`PackageError` for a missing repository, a directory that is
    not one, a dirty tree or an unknown commit.
    """
    if is_git_url(repo):
        git_dir, work_tree = _mirror(repo), None
        if commit is None or _resolve_commit(git_dir, commit) is None:
            _fetch_mirror(repo, git_dir, commit)
    else:
        path = os.path.abspath(os.path.join(base_dir or os.getcwd(), repo))
        if not os.path.isdir(path):
            raise PackageError(f"repository not found: {path} is not a directory")
        try:
            bare = _git_out(["rev-parse", "--is-bare-repository"], cwd=path) == "true"
            git_dir = _git_out(["rev-parse", "--absolute-git-dir"], cwd=path)
            work_tree = None if bare else _git_out(["rev-parse", "--show-toplevel"], cwd=path)
        except subprocess.CalledProcessError:
            raise PackageError(f"not a git repository: {path}") from None
        if commit is None and work_tree is not None:
            status = _git(["status", "--porcelain=v1", "-z", "--untracked-files=normal"], cwd=work_tree).stdout
            dirty = [x.decode("utf-8", "replace")[3:] for x in status.split(b"\0") if x[:3].strip()]
            if dirty:
                shown = ", ".join(dirty[:3]) + (f" and {len(dirty) - 3} more" if len(dirty) > 3 else "")
                raise PackageError(f"{work_tree} has uncommitted changes ({shown}): commit them, or name the "
                                   "commit to package with --commit")
    want = commit or "HEAD"
    sha = _resolve_commit(git_dir, want)
    if sha is None:
        raise PackageError(f"unknown commit {want!r} in {repo}")
    tree = _git_out(["rev-parse", f"{sha}^{{tree}}"], git_dir=git_dir)
    commit_time = int(_git_out(["show", "-s", "--format=%ct", sha], git_dir=git_dir) or 0)
    return GitSource(repo, git_dir, work_tree, sha, tree, commit_time)


def export_tree(src: GitSource, dest: str, *, include_git: bool = False, gitignore: bool = False) -> int:
    """Write the tree of ``src.commit`` into the empty directory ``dest``; returns the files removed
    by ``gitignore``.

    Without ``include_git`` the tree comes from ``git archive`` (modes 0644/0755, mtimes of the
    commit, ``export-ignore`` attributes honoured); with it, from a clone checked out at the commit
    (detached HEAD, no remote), so ``git diff`` works in the env. With ``gitignore``, tracked files
    that the commit's own ``.gitignore`` files match are left out (host-wide excludes are not used).
    """
    try:
        if include_git:
            _git(["clone", "--quiet", "--no-checkout", "--no-hardlinks", src.git_dir, dest])
            if _resolve_commit(os.path.join(dest, ".git"), src.commit) is None:  # only reflog or HEAD reach it
                _git(["fetch", "--quiet", "origin", src.commit], cwd=dest)
            _git(["checkout", "--quiet", "--detach", src.commit], cwd=dest)
            _git(["remote", "remove", "origin"], cwd=dest)
        else:
            fd, tar_path = tempfile.mkstemp(prefix="weenv-package-", suffix=".tar", dir=tmp_dir())
            os.close(fd)
            try:
                _git(["-c", "tar.umask=0022", "archive", "--format=tar", "-o", tar_path, src.commit],
                     git_dir=src.git_dir)
                with tarfile.open(tar_path) as tf:
                    tf.extractall(dest, filter="tar")
            finally:
                os.unlink(tar_path)
    except subprocess.CalledProcessError as e:
        raise PackageError(f"cannot export {src.origin}: {_first_line(e)}") from None
    if not gitignore:
        return 0
    names = _git(["ls-tree", "-r", "-z", "--name-only", src.commit], git_dir=src.git_dir).stdout
    p = _git(["-c", "core.excludesFile=/dev/null", "--work-tree", dest, "check-ignore", "--no-index", "-z",
              "--stdin"], git_dir=src.git_dir, input=names, ok_codes=(0, 1))
    removed = 0
    for raw in p.stdout.split(b"\0"):
        if not raw:
            continue
        path = os.path.join(dest, os.fsdecode(raw))
        if os.path.lexists(path) and not os.path.isdir(path):
            os.unlink(path)
            removed += 1
            try:
                os.utime(os.path.dirname(path), (src.commit_time, src.commit_time))
            except OSError:
                pass
    return removed


# =============================================================================== layers


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
    snap = c._request("GET", f"/v1/snapshots/{done.snapshot}").json()
    return [x["digest"] for x in snap["layers"]]


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


# =============================================================================== batch


class TaskSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """One line of a tasks file. Unset options take the command line's values."""

    id: Annotated[str, msgspec.Meta(pattern=TASK_ID_PATTERN)]
    repo: Annotated[str, msgspec.Meta(min_length=1)]
    commit: str | None = None
    setup: list[str] = []
    env: dict[str, str] = {}
    workdir: Annotated[str, msgspec.Meta(pattern=r"^/[^\x00]*$")] | None = None
    include_git: bool | None = None
    gitignore: bool | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None


def load_tasks(path: str) -> list[TaskSpec]:
    """Every task of a JSONL file, checked before any runs; :class:`TasksFileError` names FILE:LINE."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as e:
        raise TasksFileError(f"cannot read tasks file {path}: {e.strerror}") from None
    decoder = msgspec.json.Decoder(TaskSpec)
    tasks: list[TaskSpec] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            task = decoder.decode(line)
        except msgspec.ValidationError as e:
            raise TasksFileError(f"{path}:{lineno}: {e}") from None
        except msgspec.DecodeError as e:
            raise TasksFileError(f"{path}:{lineno}: not a JSON object: {e}") from None
        if task.id in first_line:
            raise TasksFileError(f"{path}:{lineno}: duplicate task id {task.id!r} (first on line {first_line[task.id]})")
        first_line[task.id] = lineno
        tasks.append(task)
    if not tasks:
        raise TasksFileError(f"{path}: no tasks")
    return tasks


class TaskRecord(msgspec.Struct, kw_only=True):
    """One line of the results file: the outcome of one task (the latest line of an id wins)."""

    id: str
    status: str  # "ok" | "failed"
    ref: str | None = None
    digest: str | None = None
    lock: str | None = None
    uploaded_bytes: int = 0
    seconds: float = 0.0
    cached: bool = False
    commit: str | None = None
    error: str | None = None


def read_results(path: str) -> dict[str, TaskRecord]:
    """The latest record of each id in a results file (missing file: none; a torn last line is skipped)."""
    out: dict[str, TaskRecord] = {}
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return out
    except OSError as e:
        raise TasksFileError(f"cannot read results file {path}: {e.strerror}") from None
    decoder = msgspec.json.Decoder(TaskRecord)
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            rec = decoder.decode(line)
        except msgspec.MsgspecError:
            continue  # a line cut short by a crash: that task simply runs again
        out[rec.id] = rec
    return out


@dataclass
class BatchResult:
    total: int
    ok: int
    failed: int
    skipped: int  # finished OK in an earlier run
    uploaded_bytes: int
    seconds: float
    results: str  # path of the results file
    failed_ids: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


BatchEvent = Callable[[str, str, Any], Any]
"""``on_event(kind, task_id, data)``: kind "start" (data None), "stage" (text) or "done" (TaskRecord)."""


def default_results_path(tasks_path: str) -> str:
    stem = tasks_path[:-6] if tasks_path.endswith(".jsonl") else tasks_path
    return f"{stem}.results.jsonl"


def package_tasks(tasks_path: str, *, base: Any, ref_template: str, jobs: int = 4, results_path: str | None = None,
                  locks_dir: str | None = None, setup: list[str] | tuple[str, ...] = (),
                  workdir: str = DEFAULT_WORKDIR, include_git: bool = False, gitignore: bool = False,
                  setup_timeout_s: float | None = DEFAULT_SETUP_TIMEOUT_S, keep_snapshots: bool = False,
                  network: str | None = None,
                  client_factory: Callable[[], Client] | None = None,
                  on_event: BatchEvent | None = None) -> BatchResult:
    """Package every task of a JSONL file with ``jobs`` in parallel; resumable and failure-isolated.

    Each finished task appends one :class:`TaskRecord` line to ``results_path`` (default
    ``TASKS.results.jsonl``); ids whose latest record is "ok" are skipped. ``setup`` commands run
    before each task's own; ``workdir``/``include_git``/``gitignore`` are defaults a task may override.
    Locks go to ``locks_dir`` (default ``locks/`` next to the tasks file) as ``ID.lock.toml``.
    """
    if "{id}" not in ref_template:
        raise PackageError(f"--ref-template {ref_template!r} must contain {{id}}")
    try:
        ref_template.format(id="x")
    except (KeyError, IndexError, ValueError) as e:
        raise PackageError(f"--ref-template {ref_template!r}: only {{id}} may be substituted ({e})") from None
    tasks = load_tasks(tasks_path)
    tasks_dir = os.path.dirname(os.path.abspath(tasks_path))
    results_path = results_path or default_results_path(tasks_path)
    locks_dir = locks_dir or os.path.join(tasks_dir, "locks")
    emit = on_event or (lambda kind, task_id, data: None)
    t0 = time.perf_counter()
    previous = read_results(results_path)
    todo = [t for t in tasks if not (t.id in previous and previous[t.id].status == "ok")]
    skipped = len(tasks) - len(todo)
    base_lock = _load_base(base) if todo else None  # resolved once for every task
    write_lock = threading.Lock()
    records: list[TaskRecord] = []
    os.makedirs(os.path.dirname(os.path.abspath(results_path)), exist_ok=True)
    factory = client_factory or (lambda: Client(timeout_s=(setup_timeout_s or 24 * 3600.0) + 120.0))

    def one(task: TaskSpec) -> None:
        emit("start", task.id, None)
        started = time.perf_counter()
        ref = ref_template.format(id=task.id)
        try:
            with factory() as c:
                res = package(task.repo, base=base_lock, ref=ref, commit=task.commit, setup=[*setup, *task.setup],
                              workdir=task.workdir or workdir, env=task.env,
                              gitignore=gitignore if task.gitignore is None else task.gitignore,
                              include_git=include_git if task.include_git is None else task.include_git,
                              lock_out=os.path.join(locks_dir, f"{task.id}.lock.toml"), name=task.id,
                              setup_timeout_s=task.timeout_s or setup_timeout_s, keep_snapshots=keep_snapshots,
                              network=network,
                              base_dir=tasks_dir, client=c,
                              on_stage=lambda text: emit("stage", task.id, text))
            rec = TaskRecord(id=task.id, status="ok", ref=res.ref, digest=res.digest, lock=res.lock,
                             uploaded_bytes=res.uploaded_bytes, seconds=round(time.perf_counter() - started, 3),
                             cached=res.cached, commit=res.commit)
        except Exception as e:  # one task's failure, whatever it is, must not stop the others
            msg = str(e) if isinstance(e, (WeenvError, OSError)) else f"{type(e).__name__}: {e}"
            rec = TaskRecord(id=task.id, status="failed", ref=ref, seconds=round(time.perf_counter() - started, 3),
                             error=msg or type(e).__name__)
        line = msgspec.json.encode(rec) + b"\n"
        with write_lock:
            with open(results_path, "ab") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            records.append(rec)
        emit("done", task.id, rec)

    if todo:
        with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="weenv-package") as pool:
            for fut in [pool.submit(one, t) for t in todo]:
                fut.result()
    failed = [r.id for r in records if r.status != "ok"]
    return BatchResult(total=len(tasks), ok=len(records) - len(failed), failed=len(failed), skipped=skipped,
                       uploaded_bytes=sum(r.uploaded_bytes for r in records), seconds=time.perf_counter() - t0,
                       results=os.path.abspath(results_path), failed_ids=sorted(failed))


# =============================================================================== check


@dataclass
class CheckResult:
    lock: str
    env_id: str
    start_seconds: float
    smoke: str | None = None
    exit_code: int = 0
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def check_lock(lock_path: str, smoke: str | None = None, *, timeout_s: float | None = 600.0,
               client: Client | None = None) -> CheckResult:
    """Start an env from a task lock and run ``smoke`` (``/bin/sh -c``) in it; the env is killed after.

    :class:`PackageError` when the lock cannot be read or the env does not start; the smoke
    command's own failure is its exit code in the result, not an error.
    """
    from ..plan import PlanError, load_any

    try:
        load_any(lock_path)
    except (PlanError, OSError) as e:
        raise PackageError(f"cannot check {lock_path}: {e}") from None
    own = client is None
    c = client or Client(timeout_s=(timeout_s or 24 * 3600.0) + 120.0)
    try:
        t0 = time.perf_counter()
        try:
            env = c.create(lock_path)
        except WeenvError as e:
            raise PackageError(f"cannot start an env from {lock_path}: {e}") from None
        with env:
            started = time.perf_counter() - t0
            result = CheckResult(lock=os.path.abspath(lock_path), env_id=env.id, start_seconds=round(started, 3),
                                 smoke=smoke)
            if smoke is not None:
                try:
                    r = env.exec(["/bin/sh", "-c", smoke], timeout_s=timeout_s)
                except WeenvError as e:
                    raise PackageError(f"cannot run the smoke command in {env.id}: {e}") from None
                result.exit_code = r.exit_code
                result.stdout = r.stdout.decode("utf-8", "replace")
                result.stderr = r.stderr.decode("utf-8", "replace")
                result.timed_out = r.timed_out
        return result
    finally:
        if own:
            c.close()
