"""Sources for ``weenv package``: a repository (a local path or a git URL, mirrored once per node)
at a commit, exported as a tree (``git archive``, or a clone checked out at the commit)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .. import _home
from ._build import (
    tmp_dir,
)
from ._package_errors import PackageError

_URL = re.compile(r"^([a-z][a-z0-9+.-]*://|[A-Za-z0-9._-]+@[^:/\s]+:)")

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
