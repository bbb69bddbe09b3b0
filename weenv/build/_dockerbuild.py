"""``weenv build -f Dockerfile CONTEXT``: a Dockerfile built in weenv envs, into a lock.

Each stage starts ``FROM`` an image (converted per layer, :mod:`weenv.registry._convert`), a
weenv group ref, a plan or lock file, a snapshot id or an earlier stage. Each ``RUN`` runs in an
env started from the previous step's snapshot and is committed into the next one; ``COPY`` /
``ADD`` send a tar of what they copy (built here, with Docker's ownership and mode rules) into
such an env. A step whose inputs are unchanged (its parent, the instruction, the ENV / ARG /
WORKDIR / USER in force, the copied files' digests) is taken from the step cache, as Docker does.

The result is a lock: the base's groups, then one group per built layer, each published at a tag
named by its layer digest (``[store/]build-layers:sha256-<hex>``), so a rebuild whose last step
changed publishes only that step's layer (every earlier one is found, 0 bytes uploaded), and two
Dockerfiles with a common prefix share its groups. ``--squash`` makes one group of them instead.
The Dockerfile's metadata fills the lock: ENV, WORKDIR, USER, and CMD / ENTRYPOINT / EXPOSE /
LABEL / STOPSIGNAL in its ``[image]`` table.
"""

from __future__ import annotations

import copy
import glob
import os
import posixpath
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .. import _home
from .._client import Client, Env, WeenvError
from ._build import StepCache, StepFailedError, StepResult, _file_digest, _sha, _tail, base_key, tmp_dir
from ._dockerfile import (
    Dockerfile,
    DockerfileError,
    Instruction,
    Stage,
    arg_values,
    argv_of,
    exposed,
    key_values,
    parse,
    substitute,
    words,
)

DEFAULT_SHELL = ["/bin/sh", "-c"]
BUILD_LAYERS = "build-layers"


@dataclass
class StageState:
    """Where a stage is: what its next env starts from, the cache key so far, and its metadata."""

    start: dict[str, Any] | str
    key: str
    base_lock: Any
    snapshot: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    args: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    shell: list[str] = field(default_factory=lambda: list(DEFAULT_SHELL))
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    ports: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    stop_signal: str = ""

    @property
    def origin(self) -> dict[str, Any] | str:
        return self.snapshot if self.snapshot is not None else self.start

    def scope(self) -> dict[str, str]:
        """Variables ``$VAR`` sees: the base's env, the stage's ARGs, its ENV (ENV wins)."""
        return {**dict(self.base_lock.env), **self.args, **self.env}


@dataclass
class DockerBuildResult:
    lock_path: str
    lock: Any
    stage: str
    groups: list[str]
    uploaded_bytes: int
    steps: list[StepResult]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"lock": self.lock_path, "stage": self.stage, "groups": self.groups,
                "uploaded_bytes": self.uploaded_bytes, "seconds": round(self.seconds, 3),
                "steps": [s.__dict__ for s in self.steps]}


class _Builder:
    def __init__(self, c: Client, df: Dockerfile, context: str, *, build_args: dict[str, str], network: str | None,
                 store: str, say: Callable[[str], Any], cache: StepCache):
        self.c, self.df, self.context, self.network, self.store, self.say = c, df, context, network, store, say
        self.cache = cache
        self.build_args = build_args
        self.global_args: dict[str, str] = {}
        for ins in df.global_args:
            for k, v in arg_values(ins, self.global_args, {}, df.path):
                if build_args.get(k, v) is not None:
                    self.global_args[k] = build_args.get(k, v)  # type: ignore[assignment]
        self.done: dict[int, StageState] = {}
        self.steps: list[StepResult] = []
        self._included: set[str] | None = None
        # for builds on a server's behalf (weenv/build/_templatebuild.py): skip the cache, a deadline
        # (time.monotonic()) that bounds every env and command, and RUN output as it comes
        self.force = False
        self.deadline: float | None = None
        self.on_output: Callable[[str, bytes], Any] | None = None
        # for builds on an API key's behalf (weenv/api/_docker_build.py): every ref a FROM or a
        # COPY --from names (not an earlier stage) is checked before it is read (and may be
        # replaced: the key's own image names); each instruction is announced before it runs
        self.check_ref: Callable[[str, str], str | None] | None = None
        self.on_instruction: Callable[[Stage, Instruction | None], Any] | None = None

    # ------------------------------------------------------------------ FROM

    def from_ref(self, ref: str, where: str, before: int) -> StageState:
        from ..plan import Group, Lock, Plan, load_any, lock_plan
        from ..registry import is_image_ref, lock_for_image, resolve_group

        if ref.lower() == "scratch":
            raise DockerfileError(f"{where}: FROM scratch is not supported (an env needs a base: name an image)")
        named = [s for s in self.df.stages[:before] if s.name == ref.lower() or str(s.index) == ref]
        if named:
            return copy.deepcopy(self.done[named[-1].index])
        if self.check_ref is not None:
            ref = self.check_ref(ref, where) or ref
        if ref.startswith("snap-"):
            snap = self.c.snapshot(ref)
            lock = msgspec.convert(snap.lock, Lock)
            return self._state(lock, ref, _sha("snapshot", ref, snap.layers))
        path = ref if os.path.isabs(ref) else os.path.join(os.path.dirname(os.path.abspath(self.df.path)), ref)
        try:
            if os.path.isfile(path):
                doc = load_any(path)
                lock = doc if isinstance(doc, Lock) else lock_plan(doc, resolve_group)
            elif is_image_ref(ref):
                lock = lock_for_image(ref, base=self.store)
            else:  # a weenv group ref: a base of that one os group
                lock = lock_plan(Plan(name="build", groups=[Group(name="os", ref=ref, group_class="os")]),
                                 resolve_group)
        except WeenvError as e:
            raise DockerfileError(f"{where}: {e}") from None
        return self._state(lock, msgspec.to_builtins(lock), base_key(lock))

    def _state(self, lock: Any, start: dict[str, Any] | str, key: str) -> StageState:
        img = lock.image
        return StageState(start=start, key=_sha("from", key, dict(lock.env), lock.workdir, lock.user), base_lock=lock, workdir=lock.workdir, user=lock.user,
                          entrypoint=list(img.entrypoint) if img else [], cmd=list(img.cmd) if img else [],
                          ports=list(img.ports) if img else [], labels=dict(img.labels) if img else {},
                          stop_signal=img.stop_signal if img else "")

    # ------------------------------------------------------------------ steps

    def run_stage(self, stage: Stage) -> StageState:
        base = substitute(stage.base, self.global_args, {})
        if self.on_instruction is not None:
            self.on_instruction(stage, None)
        st = self.from_ref(base, f"{self.df.path}:{stage.line}: FROM", stage.index)
        st.args = {}
        for ins in stage.instructions:
            if self.on_instruction is not None:
                self.on_instruction(stage, ins)
            self.instruction(st, stage, ins)
        self.done[stage.index] = st
        return st

    def instruction(self, st: StageState, stage: Stage, ins: Instruction) -> None:
        path, op = self.df.path, ins.op
        scope = st.scope()
        if op == "ARG":
            for k, v in arg_values(ins, st.args, scope, path):
                given = self.build_args.get(k, self.global_args.get(k, v))
                if given is not None:
                    st.args[k] = given
        elif op == "ENV":
            st.env.update(key_values(ins, st.args, {**dict(st.base_lock.env), **st.env}, path))
        elif op == "LABEL":
            st.labels.update(key_values(ins, st.args, scope, path))
        elif op == "WORKDIR":
            wd = substitute(ins.value, st.args, scope)
            st.workdir = posixpath.normpath(posixpath.join(st.workdir or "/", wd))
        elif op == "USER":
            st.user = substitute(ins.value, st.args, scope)
        elif op == "SHELL":
            st.shell = list(ins.exec_form or [])
        elif op == "EXPOSE":
            st.ports += [p for p in exposed(ins, st.args, scope, path) if p not in st.ports]
        elif op == "STOPSIGNAL":
            st.stop_signal = substitute(ins.value, st.args, scope)
        elif op == "CMD":
            st.cmd = argv_of(ins, st.shell)
        elif op == "ENTRYPOINT":
            st.entrypoint, st.cmd = argv_of(ins, st.shell), []  # as Docker: a new ENTRYPOINT drops the base's CMD
        elif op == "RUN":
            self.run(st, ins)
        else:
            self.copy_step(st, stage, ins)
        if op in ("ARG", "ENV", "WORKDIR", "USER", "SHELL"):
            st.key = _sha(st.key, op, ins.value, st.args, st.env, st.workdir, st.user, st.shell)

    def remaining_s(self) -> float | None:
        """Seconds left before the deadline (None: no deadline); a StepFailedError when none are."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise StepFailedError("the build ran out of time", index=len(self.steps), exit_code=-1, output_tail="",
                                  timed_out=True)
        return left

    def _env(self, st: StageState) -> Env:
        left = self.remaining_s()
        env = self.c.create(st.origin, network=self.network, ttl_s=None if left is None else left + 30)
        if st.workdir and st.workdir != "/":
            env.mkdir(st.workdir)  # as Docker: WORKDIR makes the directory
        return env

    def _cached(self, key: str, ins: Instruction, t0: float, n: int) -> str | None:
        snap = None if self.force else self.cache.get(key)
        if snap is None:
            return None
        try:
            self.c.snapshot(snap)
        except WeenvError:
            return None  # the cached snapshot was deleted: build the step again
        self.steps.append(StepResult(n, ins.op.lower(), True, time.perf_counter() - t0, snap))
        self.say(f"{ins.where(self.df.path)}: cached ({snap})")
        return snap

    def _commit(self, st: StageState, env: Env, key: str, ins: Instruction, t0: float) -> None:
        st.snapshot = env.commit()
        st.key = key
        self.cache.put(key, st.snapshot)
        self.steps.append(StepResult(len(self.steps), ins.op.lower(), False, time.perf_counter() - t0, st.snapshot))
        self.say(f"{ins.where(self.df.path)}: done in {time.perf_counter() - t0:.1f}s ({st.snapshot})")

    def run(self, st: StageState, ins: Instruction) -> None:
        t0 = time.perf_counter()
        argv = argv_of(ins, st.shell)
        env_vars = {**st.args, **st.env}  # ARGs are the command's env too, never the image's
        key = _sha(st.key, "RUN", argv, env_vars, st.workdir, st.user, self.network)

        def work(env: Env) -> None:
            r = env.exec(argv, env=env_vars or None, cwd=st.workdir, user=st.user, timeout_s=self.remaining_s(),
                         on_output=self.on_output)
            if r.exit_code != 0:
                detail = _tail(r.stdout + r.stderr)
                raise StepFailedError(f"{ins.where(self.df.path)} {ins.value[:200]!r} failed with exit code "
                                      f"{r.exit_code}; output tail:\n{detail}", index=len(self.steps),
                                      exit_code=r.exit_code, output_tail=detail, timed_out=r.timed_out)

        self._step(st, key, ins, t0, work)

    def _step(self, st: StageState, key: str, ins: Instruction, t0: float, work: Callable[[Env], None]) -> None:
        """The step's snapshot from the cache, or ``work`` done in an env of the stage, committed."""
        cached = self._cached(key, ins, t0, len(self.steps))
        if cached is not None:
            st.snapshot, st.key = cached, key
            return
        env = self._env(st)
        try:
            work(env)
            self._commit(st, env, key, ins, t0)
        finally:
            env.kill()

    # ------------------------------------------------------------------ COPY / ADD

    def included(self) -> set[str]:
        """Context paths (relative) that .dockerignore leaves in, files and directories."""
        if self._included is None:
            from docker.utils.build import PatternMatcher

            patterns: list[str] = []
            try:
                with open(os.path.join(self.context, ".dockerignore"), encoding="utf-8") as f:
                    patterns = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
            except FileNotFoundError:
                pass
            self._included = set(PatternMatcher(patterns).walk(self.context)) if patterns else {
                os.path.relpath(os.path.join(d, n), self.context)
                for d, ds, fs in os.walk(self.context) for n in ds + fs}
        return self._included

    def sources(self, ins: Instruction, patterns: list[str]) -> list[str]:
        """Context paths (relative) the COPY sources name, globs expanded, .dockerignore applied."""
        root = os.path.realpath(self.context)
        inc = self.included()
        out: list[str] = []
        for pat in patterns:
            rel = posixpath.normpath(pat.lstrip("/")) if pat.strip("/") else "."
            if rel == ".." or rel.startswith("../"):
                raise DockerfileError(f"{ins.where(self.df.path)}: {pat!r} is outside the build context")
            if rel.startswith(("http://", "https://", "git@")) or "://" in pat:
                raise DockerfileError(f"{ins.where(self.df.path)}: {pat!r}: a build fetches nothing from the network "
                                      "(download it into the context first)")
            hits = [rel] if rel == "." else sorted(
                h for h in glob.glob(rel, root_dir=root, include_hidden=True) if h in inc) \
                if glob.has_magic(rel) else ([rel] if rel in inc else [])
            if not hits:
                raise DockerfileError(f"{ins.where(self.df.path)}: {pat!r} is not in the build context {self.context}"
                                      + (" (.dockerignore leaves it out)" if os.path.lexists(os.path.join(root, rel))
                                         else ""))
            out += hits
        return out

    def copy_step(self, st: StageState, stage: Stage, ins: Instruction) -> None:
        t0 = time.perf_counter()
        where = ins.where(self.df.path)
        parts = list(ins.exec_form) if ins.exec_form is not None else words(ins.value, st.args, st.scope())
        if len(parts) < 2:
            raise DockerfileError(f"{where}: expected SRC... DEST")
        srcs, dest = parts[:-1], parts[-1]
        dest = posixpath.join(st.workdir or "/", dest) if not dest.startswith("/") else dest
        flags = {k: substitute(v, st.args, st.scope()) for k, v in ins.flags.items()}
        chmod = _octal(flags.get("chmod"), where)
        many = len(srcs) > 1 or any(glob.has_magic(s) for s in srcs)
        if many and not dest.endswith("/"):
            raise DockerfileError(f"{where}: with several sources the destination must end with '/' ({dest!r})")
        if "from" in flags:
            src_state = self.from_ref(flags["from"], where, stage.index)
            key = _sha(st.key, ins.op, src_state.key, src_state.snapshot, srcs, dest, flags)
            fill: Callable[[Env, tarfile.TarFile], None] = lambda env, out: self._from_stage(  # noqa: E731
                src_state, srcs, dest, chmod, self._owner(env, flags.get("chown"), where), out, where)
        else:
            rels = self.sources(ins, srcs)
            listing = [_describe(os.path.join(self.context, r), r) for r in rels]
            key = _sha(st.key, ins.op, listing, dest, flags)
            fill = lambda env, out: self._from_context(  # noqa: E731
                env, rels, dest, many, chmod, self._owner(env, flags.get("chown"), where), out, ins.op == "ADD")

        def work(env: Env) -> None:
            with tempfile.TemporaryFile(dir=tmp_dir()) as spool:
                archives: list[tuple[str, str]] = []
                with tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as out:
                    out.archives = archives  # type: ignore[attr-defined]
                    fill(env, out)
                spool.seek(0)
                env.put_archive("/", iter(lambda: spool.read(1 << 20), b""))
            for host_path, into in archives:  # ADD of a local tar: unpacked where it lands
                env.mkdir(into)
                with open(host_path, "rb") as f:
                    env.put_archive(into, iter(lambda: f.read(1 << 20), b""))

        self._step(st, key, ins, t0, work)

    def _owner(self, env: Env, chown: str | None, where: str) -> tuple[int, int]:
        if not chown:
            return 0, 0
        user, _, group = chown.partition(":")
        if user.isdigit() and (not group or group.isdigit()):
            return int(user), int(group or user)
        from ..provision.runtime._ocispec import parse_user

        texts = []
        for name in ("/etc/passwd", "/etc/group"):
            try:
                texts.append(env.read_file(name).decode("utf-8", "replace"))
            except WeenvError:
                texts.append("")
        try:
            who = parse_user(chown, texts[0], texts[1])
        except Exception as e:  # noqa: BLE001 - UserNotFoundError, SpecError
            raise DockerfileError(f"{where}: --chown={chown}: {e}") from None
        return who.uid, who.gid

    def _from_context(self, env: Env, rels: list[str], dest: str, many: bool, chmod: int | None,
                      owner: tuple[int, int], out: tarfile.TarFile, is_add: bool) -> None:
        inc = self.included()
        for rel in rels:
            full = os.path.join(self.context, rel)
            if os.path.isdir(full):  # its contents go into dest
                if not _is_dir(env, dest):  # made by this COPY: owned as its files are
                    _add(out, full, dest, chmod, owner)
                for d, dirs, files in os.walk(full):
                    dirs.sort()
                    for name in sorted(dirs) + sorted(files):
                        p = os.path.join(d, name)
                        r = os.path.relpath(p, self.context)
                        if r in inc:
                            _add(out, p, posixpath.join(dest, os.path.relpath(p, full)), chmod, owner)
                continue
            if is_add and tarfile.is_tarfile(full):
                out.archives.append((full, dest))  # type: ignore[attr-defined]
                continue
            target = dest
            if many or dest.endswith("/") or _is_dir(env, dest):
                target = posixpath.join(dest, os.path.basename(rel))
            _add(out, os.path.realpath(full), target, chmod, owner)

    def _from_stage(self, src: StageState, srcs: list[str], dest: str, chmod: int | None, owner: tuple[int, int],
                    out: tarfile.TarFile, where: str) -> None:
        import io

        env = self.c.create(src.origin, network="none")
        try:
            for s in srcs:
                if glob.has_magic(s):
                    raise DockerfileError(f"{where}: COPY --from takes paths, not patterns ({s!r})")
                try:
                    data = env.get_archive(s)
                    is_dir = env.stat(s).kind == "dir" or _is_dir(env, s)
                except WeenvError as e:
                    raise DockerfileError(f"{where}: --from={src.key[:12]}: {s!r}: {e}") from None
                top = posixpath.basename(posixpath.normpath(s)) or "."
                with tarfile.open(fileobj=io.BytesIO(data)) as tin:
                    for m in tin:
                        rest = m.name[len(top):].lstrip("/") if m.name.startswith(top) else m.name
                        if is_dir:
                            if not rest:
                                continue
                            name = posixpath.join(dest, rest)
                        else:
                            name = posixpath.join(dest, top) if dest.endswith("/") or len(srcs) > 1 else dest
                        m.name = name.lstrip("/")
                        if m.islnk():
                            lrest = m.linkname[len(top):].lstrip("/")
                            m.linkname = posixpath.join(dest, lrest).lstrip("/") if is_dir else m.linkname
                        m.uid, m.gid, m.uname, m.gname = owner[0], owner[1], "", ""
                        if chmod is not None and not m.issym():
                            m.mode = chmod
                        out.addfile(m, tin.extractfile(m) if m.isfile() else None)
        finally:
            env.kill()

    # ------------------------------------------------------------------ result

    def publish(self, st: StageState, *, squash: bool, group: str, group_class: str, source: str) -> tuple[list, int]:
        """The lock groups of the built layers (published where missing) and the bytes uploaded."""
        from ..registry import LayoutStore

        if st.snapshot is None:
            return [], 0
        digests = [x["digest"] for x in self.c.snapshot(st.snapshot).layers]
        if not squash:
            store = LayoutStore(_home.store_dir())
            return self._publish([(f"step{i}", store.blob_path(d), d) for i, d in enumerate(digests)], group_class,
                                 source)
        from ._build import squash_layers

        with tempfile.TemporaryDirectory(dir=tmp_dir()) as tmp:
            path = os.path.join(tmp, "group.weenv")
            digest = squash_layers(digests, path, tmp)
            return self._publish([(group, path, digest)], group_class, source)

    def _publish(self, items: list[tuple[str, str, str]], group_class: str, source: str) -> tuple[list, int]:
        from ..plan import LockedGroup
        from ..registry import NotFoundError, publish_layer_file, resolve_group

        groups, uploaded = [], 0
        for name, path, digest in items:
            ref = f"{self.store}{BUILD_LAYERS}:sha256-{digest.split(':', 1)[1]}"
            try:
                info = resolve_group(ref)
            except NotFoundError:
                pub = publish_layer_file(path, ref, group=name, group_class=group_class, source=source, digest=digest)
                uploaded += pub.uploaded_bytes
                info = resolve_group(ref)
            groups.append(LockedGroup(name=name, ref=ref, group_class=group_class, digest=info.manifest_digest,
                                      layer_digest=info.layer_digest, layer_size=info.layer_size,
                                      toc_digest=info.toc_digest, registry=info.registry, repo=info.repo))
        return groups, uploaded


def _octal(text: str | None, where: str) -> int | None:
    if text is None:
        return None
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o7777:
        raise DockerfileError(f"{where}: --chmod={text} is not an octal mode")
    return mode


def _is_dir(env: Env, path: str) -> bool:
    try:
        return env.stat(path).kind == "dir"
    except WeenvError:
        return False


def _describe(full: str, rel: str) -> list[Any]:
    """What a COPY source's cache key holds: every file's path, type, mode, link and digest."""
    out: list[Any] = []
    for p in [full] if not os.path.isdir(full) else sorted(
            os.path.join(d, n) for d, ds, fs in os.walk(full) for n in ds + fs):
        st = os.lstat(p)
        r = os.path.relpath(p, os.path.dirname(full)) if p != full else rel
        kind = "l" if os.path.islink(p) else "d" if os.path.isdir(p) else "f"
        out.append([r, kind, st.st_mode & 0o7777, os.readlink(p) if kind == "l" else
                    (_file_digest(p) if kind == "f" else "")])
    return out


def _add(out: tarfile.TarFile, host_path: str, target: str, chmod: int | None, owner: tuple[int, int]) -> None:
    ti = out.gettarinfo(host_path, arcname=target.lstrip("/"))
    ti.uid, ti.gid, ti.uname, ti.gname = owner[0], owner[1], "", ""
    if chmod is not None and not ti.issym():
        ti.mode = chmod
    if ti.isfile():
        with open(host_path, "rb") as f:
            out.addfile(ti, f)
    elif ti.isdir() or ti.issym():
        out.addfile(ti)
    # sockets, fifos and devices in a context are left out, as Docker leaves them


def build_dockerfile(dockerfile: str, context: str, *, output: str | None = None, name: str | None = None,
                     build_args: dict[str, str] | None = None, target: str | None = None,
                     network: str | None = None, store: str | None = None, squash: bool = False,
                     group: str = "build", group_class: str = "task", client: Client | None = None,
                     log: Callable[[str], Any] | None = None, check_ref: Callable[[str, str], str | None] | None = None,
                     on_instruction: Callable[[Stage, Instruction | None], Any] | None = None,
                     on_output: Callable[[str, bytes], Any] | None = None,
                     deadline: float | None = None, no_cache: bool = False,
                     cache_root: str | None = None) -> DockerBuildResult:
    """Build ``dockerfile`` over ``context``; writes and returns the lock (see the module docstring).

    For a build on someone else's behalf (the Docker API's ``/build``): ``check_ref(ref, where)``
    raises for a base it may not name (or gives the ref to read instead), ``on_instruction(stage, ins)`` hears of each step before it
    runs (``ins`` None: the stage's FROM), ``on_output(stream, data)`` gets RUN's output as it
    comes, ``deadline`` (``time.monotonic()``) bounds the build; ``no_cache``: every step
    built again; ``cache_root``: the step cache's directory (one per key: no key reuses a step
    another built)."""
    from ..plan import Lock, PlanError, apply_image_defaults, plan_from_builtins, plan_to_builtins, write_plan
    from ..registry._convert import plan_name_for, store_base

    t0 = time.perf_counter()
    try:
        with open(dockerfile, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise DockerfileError(f"cannot read {dockerfile}: {e.strerror}") from None
    if not os.path.isdir(context):
        raise DockerfileError(f"build context {context!r} is not a directory")
    df = parse(text, dockerfile)
    stages = df.stages
    if target is not None:
        pick = [s for s in stages if s.name == target.lower()]
        if not pick:
            raise DockerfileError(f"{dockerfile}: no stage is named {target!r} (--target)")
        stages = stages[: pick[0].index + 1]
    own = client is None
    c = client or Client()
    try:
        b = _Builder(c, df, context, build_args=dict(build_args or {}), network=network, store=store_base(store),
                     say=log or (lambda m: None), cache=StepCache(cache_root))
        b.check_ref, b.on_instruction, b.on_output, b.deadline = check_ref, on_instruction, on_output, deadline
        b.force = no_cache
        st: StageState | None = None
        for stage in stages:
            st = b.run_stage(stage)
        assert st is not None
        built, uploaded = b.publish(st, squash=squash, group=group, group_class=group_class,
                                    source=f"weenv build -f {os.path.basename(dockerfile)}")
        base = st.base_lock
        plan_name = name or plan_name_for(os.path.basename(os.path.abspath(context)))
        image = {"source": f"dockerfile:{os.path.abspath(dockerfile)}", "entrypoint": st.entrypoint, "cmd": st.cmd,
                 "ports": st.ports, "labels": st.labels, "stop_signal": st.stop_signal}
        data = plan_to_builtins(msgspec.structs.replace(base, name=plan_name, groups=[*base.groups, *built],
                                                        env={**dict(base.env), **st.env}, workdir=st.workdir,
                                                        user=st.user or None, image=None))
        lock_path = output or os.path.join(os.path.dirname(os.path.abspath(dockerfile)), f"{plan_name}.lock.toml")
        try:
            lock = apply_image_defaults(plan_from_builtins(data, Lock, source=lock_path),
                                        {"image": {k: v for k, v in image.items() if v}})
        except PlanError as e:
            raise DockerfileError(f"{dockerfile}: the built lock is not one weenv starts: {e}") from None
        write_plan(lock, lock_path)
        return DockerBuildResult(lock_path, lock, stages[-1].name or str(stages[-1].index),
                                 [g.ref for g in built], uploaded, b.steps, time.perf_counter() - t0)
    finally:
        if own:
            c.close()
