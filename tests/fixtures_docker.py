"""A private Docker for tests: Debian's ``dockerd`` as an image producer, and a corpus it builds.

Fixtures:

- ``dockerd`` (session): Debian's dockerd (docker.io 20.10), started with a private data root,
  exec root, socket and cgroup parent, no bridge, no iptables, no IP forwarding
  (:func:`weenv.testing.start_dockerd`); ``.cli(*args)`` runs Debian's CLI against it. At the end
  it is stopped by PID and its mounts, cgroups and files are removed; anything left fails the
  session. Skipped, with the reason printed, only where dockerd cannot run.
- ``docker_corpus`` (session): images built by that dockerd from Dockerfiles and pushed with
  ``docker push`` to the test ``registry``: a base (Debian bookworm minbase + python3 + pip, made
  by mmdebstrap and imported with ``docker import``: nothing comes from Docker Hub), task images of
  two "repos" (a per-repo env layer of wheels installed with ``pip install --no-index``, then the
  repo's tree at a commit), and a "hard" image (see :data:`HARD_DOCKERFILE`).

Builds run with ``--network none``. The wheels are downloaded once, through the machine's pip
configuration, into the fixture cache (``make setup`` does it: ``python -m tests.fixtures_docker
prefetch``, which also builds the base tarball), so tests reach nothing but 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from weenv.testing import (
    BadEntry,
    Dockerd,
    HostUnsupported,
    cached,
    check_tree,
    debian_tar,
    start_dockerd,
    stop_dockerd,
)

BASE_INCLUDE = ("python3", "python3-pip")
#: The per-repo environments: pure-python wheels, pinned (the cache entry is keyed by this list).
REPO_WHEELS = {
    "repo-a": ("six==1.17.0", "idna==3.10"),
    "repo-b": ("attrs==25.3.0", "iniconfig==2.1.0"),
}
#: Paths Docker's init layer puts into every container (``docker export`` shows them): not the image's.
INIT_LAYER_PATHS = frozenset({".dockerenv", "dev/console", "dev/pts", "dev/shm", "etc/hostname", "etc/hosts",
                              "etc/mtab", "etc/resolv.conf", "proc", "sys"})
LONG_NAME = "n" * 255  # NAME_MAX: a 300-char name does not exist on Linux; the path is 300+ chars
DEEP_DIRS = [f"dir-{i}-abcdefghijklmnopqrstuvwxyz" for i in range(1, 31)]  # a path of 1,000+ chars

HARD_DOCKERFILE = """\
FROM {base}
# layer 1: what later layers delete, a hardlink pair
RUN set -e; mkdir -p /hard/gone/sub /hard/opq /hard/later; echo a > /hard/gone/sub/f; echo b > /hard/opq/old; \\
    echo x > /hard/file-deleted; echo l > /hard/later/old; echo h > /hard/h1; ln /hard/h1 /hard/h2
# layer 2: whiteouts (a file, two dirs); an opaque dir (removed and made again in the same RUN); a third link
RUN set -e; rm -rf /hard/gone /hard/file-deleted /hard/later; rm -rf /hard/opq; mkdir /hard/opq; \\
    echo new > /hard/opq/new; ln /hard/h1 /hard/h3
# layer 3: a dir re-created after its whiteout, setuid/setgid files, a file capability (the xattr Docker
# keeps; it drops user.*), a device node, a fifo, a 1 GiB sparse file, a 255-byte name, a deep path
RUN set -e; mkdir /hard/later; echo n > /hard/later/new; cp /bin/true /hard/suid; chmod 4755 /hard/suid; \\
    cp /bin/true /hard/sgid; chown 1000:1000 /hard/sgid; chmod 2711 /hard/sgid; \\
    truncate -s 1G /hard/sparse; mknod /hard/null c 1 3; mkfifo /hard/fifo; ln -s ../usr/bin/true /hard/sym; \\
    python3 -c "import os; os.setxattr('/hard/suid', 'user.note', b'v'); \\
os.setxattr('/usr/bin/true', 'security.capability', bytes.fromhex('0100000200200000000000000000000000000000'))"; \\
    echo long > /hard/{long_name}; mkdir -p /hard/deep/{deep}; echo deep > /hard/deep/{deep}/leaf
"""

TASK_DOCKERFILE = """\
FROM {base}
COPY env/ /opt/env/
RUN python3 -m pip install -q --no-index --find-links /opt/env --break-system-packages -r /opt/env/requirements.txt
COPY repo/ /work/repo/
WORKDIR /work/repo
ENV TASK={task}
CMD ["python3", "-m", "task"]
"""


# ------------------------------------------------------------------------------------- dockerd


@pytest.fixture(scope="session")
def dockerd() -> Iterator[Dockerd]:
    try:
        d = start_dockerd()
    except HostUnsupported as e:
        print(f"\nskipping Docker tests: {e}", file=sys.stderr)
        pytest.skip(str(e))
    try:
        yield d
    finally:
        left = stop_dockerd(d)
        assert not left, f"dockerd left: {left}"


# ------------------------------------------------------------------------------------- inputs


def corpus_wheels() -> Path:
    """The corpus's wheels (every repo's), downloaded once into the fixture cache with this machine's
    pip configuration (``make setup`` does it before the tests run)."""
    pins = sorted(p for ws in REPO_WHEELS.values() for p in ws)
    name = "corpus-wheels-" + "-".join(p.replace("==", "-") for p in pins)
    files = tuple(_wheel_prefix(p) for p in pins)

    def build(out: Path) -> None:
        out.mkdir()
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--dest", str(out), *pins], check=True, timeout=600)

    def check(p: Path) -> None:
        check_tree(p, ())
        names = os.listdir(p)
        missing = [w for w in files if not any(n.startswith(w) and n.endswith(".whl") for n in names)]
        if missing:
            raise BadEntry(f"{p}: no wheel for {missing}")

    return cached(name, build, check)


def _wheel_prefix(pin: str) -> str:
    project, _, version = pin.partition("==")
    return f"{project.replace('-', '_')}-{version}-"


def base_tarball() -> Path:
    """Debian bookworm minbase + python3 + pip, made by mmdebstrap (cached, keyed by its inputs)."""
    return debian_tar(include=BASE_INCLUDE)


def make_repo(path: Path, name: str, commits: int) -> list[str]:
    """A small git repository with ``commits`` commits of a package ``task``; returns the commit ids."""
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@weenv.invalid", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@weenv.invalid", "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z"}
    git = ["git", "-C", str(path)]
    path.mkdir(parents=True)
    subprocess.run([*git, "init", "-q", "-b", "main"], check=True, env=env)
    ids = []
    for n in range(commits):
        pkg = path / "task"
        pkg.mkdir(exist_ok=True)
        (pkg / "__init__.py").write_text(f'REPO = "{name}"\nCOMMIT = {n}\n')
        (pkg / "__main__.py").write_text("from task import REPO, COMMIT\nprint(REPO, COMMIT)\n")
        (pkg / f"step_{n}.py").write_text("".join(f"def f{i}(x):\n    return x * {i + n}\n" for i in range(50)))
        (path / "README.md").write_text(f"# {name}\n\ncommit {n}\n")
        subprocess.run([*git, "add", "-A"], check=True, env=env)
        subprocess.run([*git, "commit", "-q", "-m", f"commit {n}"], check=True, env=env)
        ids.append(subprocess.run([*git, "rev-parse", "HEAD"], check=True, env=env, capture_output=True,
                                  text=True).stdout.strip())
    return ids


# ------------------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class TaskImage:
    ref: str  # in the test registry
    repo: str
    commit: str
    wheels: tuple[str, ...]


@dataclass(frozen=True)
class Corpus:
    base: str  # registry ref of the base image alone
    tasks: list[TaskImage]
    hard: str  # registry ref of the hard image
    local_base: str  # the base's local tag in dockerd (FROM of every Dockerfile)

    def diff_ids(self, d: Dockerd, ref: str) -> list[str]:
        return json.loads(d.cli("image", "inspect", "--format", "{{json .RootFS.Layers}}", ref).stdout)


def build_corpus(d: Dockerd, registry_host: str, work: Path) -> Corpus:
    """The base imported and pushed, the task images and the hard image built and pushed. The three
    run side by side (42 s one after the other, ~25 s so: the base's push gzips 245 MB on one core
    while the hard image builds); dockerd uploads a layer two pushes share once."""
    local_base = "weenv-test/base:1"
    d.cli("import", str(base_tarball()), local_base)
    base = f"{registry_host}/corpus/base:1"
    d.cli("tag", local_base, base)
    wheels = corpus_wheels()

    def task_images() -> list[TaskImage]:
        tasks = []
        for repo, n_commits in (("repo-a", 2), ("repo-b", 1)):
            commits = make_repo(work / "git" / repo, repo, n_commits)
            for n, commit in enumerate(commits):
                ctx = work / "ctx" / f"{repo}-{n}"
                (ctx / "env").mkdir(parents=True)
                for pin in REPO_WHEELS[repo]:
                    prefix = _wheel_prefix(pin)
                    (w,) = [x for x in os.listdir(wheels) if x.startswith(prefix) and x.endswith(".whl")]
                    shutil.copy2(wheels / w, ctx / "env" / w)
                (ctx / "env" / "requirements.txt").write_text("\n".join(REPO_WHEELS[repo]) + "\n")
                (ctx / "repo").mkdir()
                archive = subprocess.run(["git", "-C", str(work / "git" / repo), "archive", "--format=tar", commit],
                                         check=True, capture_output=True).stdout
                subprocess.run(["tar", "-x", "-C", str(ctx / "repo")], input=archive, check=True)
                (ctx / "Dockerfile").write_text(TASK_DOCKERFILE.format(base=local_base, task=f"{repo}@{commit[:12]}"))
                ref = f"{registry_host}/corpus/{repo}:{commit[:12]}"
                d.cli("build", "-q", "--network", "none", "-t", ref, str(ctx))
                d.cli("push", ref)
                tasks.append(TaskImage(ref, repo, commit, REPO_WHEELS[repo]))
        return tasks

    def hard_image() -> str:
        ctx = work / "ctx" / "hard"
        ctx.mkdir(parents=True)
        (ctx / "Dockerfile").write_text(HARD_DOCKERFILE.format(base=local_base, long_name=LONG_NAME,
                                                               deep="/".join(DEEP_DIRS)))
        hard = f"{registry_host}/corpus/hard:1"
        d.cli("build", "-q", "--network", "none", "-t", hard, str(ctx))
        d.cli("push", hard)
        return hard

    with ThreadPoolExecutor(3) as pool:
        pushed = pool.submit(d.cli, "push", base)
        tasks, hard = pool.submit(task_images), pool.submit(hard_image)
        pushed.result()
        return Corpus(base, tasks.result(), hard.result(), local_base)


@pytest.fixture(scope="session")
def docker_corpus(dockerd: Dockerd, registry) -> Iterator[Corpus]:  # type: ignore[no-untyped-def]
    work = Path(tempfile.mkdtemp(prefix="weenv-corpus-"))
    try:
        yield build_corpus(dockerd, registry.host, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def prefetch() -> None:
    """What the corpus and the image tests need from outside 127.0.0.1 (a Debian mirror, the PyPI
    mirror), fetched ahead by ``make corpus-inputs``, so that ``make test`` does not spend its time
    budget in mmdebstrap (~30 s a tar on a fresh machine)."""
    print("corpus base:", base_tarball())
    print("corpus wheels:", corpus_wheels())
    print("debian minbase (tests/test_registry_image.py):", debian_tar())


if __name__ == "__main__":
    if sys.argv[1:] != ["prefetch"]:
        raise SystemExit("usage: python -m tests.fixtures_docker prefetch")
    prefetch()


__all__ = ["Corpus", "HARD_DOCKERFILE", "INIT_LAYER_PATHS", "TaskImage", "docker_corpus", "dockerd"]
