"""E2B's template steps (what the SDK's ``Template`` API sends to ``POST /v2/templates/.../builds/...``)
built by weenv's Dockerfile builder (:class:`weenv.build._dockerbuild._Builder`): the same envs per
``RUN`` / ``COPY``, the same step cache, the same layers published as ``build-layers`` groups, and
a lock.

What each step does, as E2B's own builder does it:

- ``RUN cmd [user]``: ``/bin/sh -c cmd`` with the ENV / WORKDIR / USER in force (``user``: that one);
- ``COPY src dest [owner [mode]]``: the tar the SDK uploaded (by its files hash) is read here and
  re-written, member by member, into a tar of what the step copies (a file to ``dest``, or into it
  when ``dest`` ends in ``/`` or is a directory; a directory's contents into ``dest``), owned by
  ``owner`` (default: the current USER, root when none was set) and sent into the step's env with the daemon's safe
  extractor (``put_archive``). Nothing is unpacked on the host; device nodes, fifos, names that
  climb out, symlinks that leave the uploaded context and hard links to what the tar has not
  made are refused, naming the member;
- ``ENV k v ...``, ``WORKDIR path`` (relative: to the one in force), ``USER name`` (made with
  ``adduser``/``useradd`` when the image has no such user, as E2B does).

Steps run as the base's user until a ``USER`` step: the image's, else weenv's default for envs
(uid 1000, E2B's ``user``); ``run_cmd(..., user="root")`` or ``set_user("root")`` for root.

The template's start command is checked at the end: started in an env of the result, its ready
command run until it exits 0 (:data:`READY_TIMEOUT_S` at most); the result is a lock.
"""

from __future__ import annotations

import os
import posixpath
import shlex
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .._client import Client, Env, WeenvError
from ._build import BuildError, StepFailedError, StepResult, _sha, base_key, tmp_dir
from ._dockerbuild import _Builder, _is_dir
from ._dockerfile import Dockerfile, Instruction

READY_TIMEOUT_S = 120.0
READY_INTERVAL_S = 0.25
STEP_KINDS = ("RUN", "COPY", "ENV", "WORKDIR", "USER")


@dataclass
class TemplateStep:
    kind: str
    args: list[str]
    force: bool = False
    files: str | None = None
    """COPY: the path of the tar the SDK uploaded (on the host; read, never unpacked there)."""
    files_digest: str | None = None
    """COPY: the sha256 of that tar (the step's cache key: what it holds, not what the client says)."""


@dataclass
class TemplateBuildResult:
    lock_path: str
    lock: Any
    groups: list[str]
    uploaded_bytes: int
    steps: list[StepResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def cached(self) -> int:
        return sum(1 for s in self.steps if s.cached)


def _ins(i: int, op: str, value: str) -> Instruction:
    return Instruction(line=i, op=op, value=value)


def _strip_glob(src: str) -> tuple[str, bool]:
    """The part of ``src`` before its first glob segment, and whether it had one."""
    parts = [p for p in posixpath.normpath(src.lstrip("/")).split("/") if p not in ("", ".")]
    for n, p in enumerate(parts):
        if any(ch in p for ch in "*?["):
            return "/".join(parts[:n]), True
    return "/".join(parts), False


def _inside(name: str) -> bool:
    norm = posixpath.normpath(name)
    return not (name.startswith("/") or norm == ".." or norm.startswith("../"))


class _StepBuilder(_Builder):
    def _commit(self, st: Any, env: Env, key: str, ins: Instruction, t0: float) -> None:
        """As the Dockerfile builder's, but a step whose layer is one the snapshot has already (in
        practice: one that changed nothing, an empty diff, again) adds no second copy of it: overlayfs
        refuses a lower directory twice."""
        parent = st.snapshot
        super()._commit(st, env, key, ins, t0)
        layers = [x["digest"] for x in self.c.snapshot(st.snapshot).layers]
        if parent is not None and layers and layers[-1] in layers[:-1]:
            dup, st.snapshot = st.snapshot, parent
            self.cache.put(key, parent)
            self.steps[-1].snapshot = parent
            try:
                self.c.delete_snapshot(dup)
            except WeenvError:
                pass


class _TemplateBuild:
    def __init__(self, c: Client, name: str, *, network: str | None, store: str, say: Callable[[str], Any],
                 on_output: Callable[[str, bytes], Any] | None, deadline: float | None, force: bool):
        from ..registry._convert import store_base
        from ._build import StepCache

        self.df = Dockerfile(path=f"template {name}", global_args=[], stages=[])
        self.b = _StepBuilder(c, self.df, "/nonexistent", build_args={}, network=network, store=store_base(store),
                          say=say, cache=StepCache())
        self.b.on_output, self.b.deadline = on_output, deadline
        self.force = force
        self.c, self.say = c, say

    # ------------------------------------------------------------------ FROM

    def start(self, base: dict[str, str]) -> Any:
        from ..plan import Lock, load_any, lock_plan
        from ..registry import lock_for_image, resolve_group

        b = self.b
        try:
            if "snapshot" in base:
                snap = self.c.snapshot(base["snapshot"])
                lock = msgspec.convert(snap.lock, Lock)
                return b._state(lock, base["snapshot"], _sha("snapshot", base["snapshot"], snap.layers))
            if "image" in base:
                self.say(f"converting image {base['image']} (once per store)")
                lock = lock_for_image(base["image"], base=b.store)
            else:
                doc = load_any(base["lock"])
                lock = doc if isinstance(doc, Lock) else lock_plan(doc, resolve_group)
        except WeenvError as e:
            raise BuildError(f"base: {e}") from None
        return b._state(lock, msgspec.to_builtins(lock), base_key(lock))

    # ------------------------------------------------------------------ steps

    def step(self, st: Any, i: int, step: TemplateStep) -> None:
        b, kind, args = self.b, step.kind, step.args
        b.force = self.force or step.force
        b.remaining_s()
        if kind == "RUN":
            self._run_as(st, _ins(i, "RUN", args[0]), args[1] if len(args) > 1 and args[1] else None)
        elif kind == "ENV":
            st.env.update(dict(zip(args[0::2], args[1::2])))
        elif kind == "WORKDIR":
            st.workdir = posixpath.normpath(posixpath.join(st.workdir or "/", args[0]))
        elif kind == "USER":
            self._user(st, i, args[0])
        else:
            self._copy(st, i, step)
        if kind in ("ENV", "WORKDIR", "USER"):
            st.key = _sha(st.key, kind, args, st.env, st.workdir, st.user)

    def _run_as(self, st: Any, ins: Instruction, user: str | None) -> None:
        before = st.user
        if user is not None:
            st.user = user
        try:
            self.b.run(st, ins)
        finally:
            st.user = before

    def _user(self, st: Any, i: int, user: str) -> None:
        name = user.partition(":")[0]
        if not name.isdigit() and name != "root":  # as E2B: a user the image lacks is made (adduser, useradd)
            q = shlex.quote(name)
            self._run_as(st, _ins(i, "RUN", f"if id -u {q} >/dev/null 2>&1; then :; elif command -v adduser "
                                            f">/dev/null; then adduser -D -g '' {q}; elif command -v useradd "
                                            f">/dev/null; then useradd -m {q}; else busybox adduser -D -g '' {q}; fi"),
                         "root")
        st.user = user

    def _copy(self, st: Any, i: int, step: TemplateStep) -> None:
        b = self.b
        ins = _ins(i, "COPY", " ".join(step.args))
        where = ins.where(self.df.path)
        src, dest = step.args[0], step.args[1]
        owner = step.args[2] if len(step.args) > 2 and step.args[2] else (st.user or "root")
        mode = int(step.args[3], 8) if len(step.args) > 3 and step.args[3] else None
        if not dest.startswith("/"):
            dest = posixpath.join(st.workdir or "/", dest)
        key = _sha(st.key, "COPY", step.files_digest, src, dest, owner, mode)
        assert step.files is not None
        tar_path = step.files

        def work(env: Env) -> None:
            who = (0, 0) if owner in ("root", "root:root", "0", "0:0") else b._owner(env, owner, where)
            with tempfile.TemporaryFile(dir=tmp_dir()) as spool:
                with tarfile.open(tar_path, "r:*") as tin, \
                        tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as out:
                    n = _rewrite(tin, out, src, dest, who, mode, lambda p: _is_dir(env, p), where)
                if n == 0:
                    raise BuildError(f"{where}: the uploaded files hold nothing under {src!r}")
                spool.seek(0)
                env.put_archive("/", iter(lambda: spool.read(1 << 20), b""))

        b._step(st, key, ins, time.perf_counter(), work)

    def finish(self, st: Any) -> None:
        """WORKDIR is made when a later step runs (weenv build's rule); the last one is made here."""
        if st.workdir and st.workdir != "/":
            ins = _ins(0, "WORKDIR", st.workdir)
            self.b._step(st, _sha(st.key, "mkdir", st.workdir), ins, time.perf_counter(), lambda env: None)

    # ------------------------------------------------------------------ start / ready

    def check_ready(self, st: Any, start_cmd: str | None, ready_cmd: str | None) -> None:
        if not start_cmd and not ready_cmd:
            return
        self.say(f"starting the start command to wait for the ready command: {start_cmd!r} / {ready_cmd!r}")
        env = self.b._env(st)
        try:
            if start_cmd:
                env.spawn(["/bin/sh", "-c", start_cmd], env=dict(st.env) or None, cwd=st.workdir,
                          user=st.user).detach()
            ok, detail = wait_ready(env, ready_cmd, env_vars=dict(st.env), cwd=st.workdir, user=st.user,
                                    timeout_s=min(READY_TIMEOUT_S, self.b.remaining_s() or READY_TIMEOUT_S))
            if not ok:
                raise StepFailedError(f"the ready command {ready_cmd!r} did not succeed within the time: {detail}",
                                      index=-1, exit_code=-1, output_tail=detail, timed_out=True)
            self.say("the ready command succeeded")
        finally:
            env.kill()


def wait_ready(env: Env, ready_cmd: str | None, *, env_vars: dict[str, str] | None, cwd: str | None,
               user: str | None, timeout_s: float) -> tuple[bool, str]:
    """Run ``ready_cmd`` until it exits 0 or ``timeout_s`` passes: (ready, its last output)."""
    if not ready_cmd:
        return True, ""
    end = time.monotonic() + timeout_s
    detail = ""
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return False, detail
        r = env.exec(["/bin/sh", "-c", ready_cmd], env=env_vars or None, cwd=cwd, user=user,
                     timeout_s=max(1.0, min(left, 30.0)))
        if r.exit_code == 0:
            return True, ""
        detail = f"exit code {r.exit_code}: " + (r.stdout + r.stderr)[-1000:].decode("utf-8", "replace")
        time.sleep(READY_INTERVAL_S)


def _rewrite(tin: tarfile.TarFile, out: tarfile.TarFile, src: str, dest: str, owner: tuple[int, int],
             mode: int | None, is_dir: Callable[[str], bool], where: str) -> int:
    """The members of the uploaded tar that ``COPY src dest`` copies, renamed to where they land."""
    top, globbed = _strip_glob(src)
    renamed: dict[str, str] = {}
    n = 0
    into_dest = globbed or dest.endswith("/")
    for m in tin:
        name = posixpath.normpath(m.name)
        if not _inside(m.name) or "\0" in m.name:
            raise BuildError(f"{where}: uploaded member {m.name[:200]!r} climbs out of the context")
        if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
            raise BuildError(f"{where}: uploaded member {m.name[:200]!r} is a device, fifo or socket: refused")
        if m.issym() and (m.linkname.startswith("/") or
                          not _inside(posixpath.join(posixpath.dirname(name), m.linkname))):
            raise BuildError(f"{where}: uploaded symlink {m.name[:200]!r} -> {m.linkname[:200]!r} leaves the "
                             "context (copy with resolve_symlinks=True, or link inside it)")
        if top and name != top and not name.startswith(top + "/"):
            continue
        rest = name[len(top):].lstrip("/") if top else name
        if not rest:  # the source itself
            if m.isdir():
                target = dest
            elif into_dest or is_dir(dest):
                target = posixpath.join(dest, posixpath.basename(name))
            else:
                target = dest
        else:
            target = posixpath.join(dest, rest)
        target = posixpath.normpath(target)
        if m.islnk():
            link = renamed.get(posixpath.normpath(m.linkname))
            if link is None:
                raise BuildError(f"{where}: uploaded hard link {m.name[:200]!r} names what the copy has not made")
            m.linkname = link
        renamed[name] = target.lstrip("/")
        m.name = target.lstrip("/") or "."
        m.uid, m.gid, m.uname, m.gname = owner[0], owner[1], "", ""
        if mode is not None and not m.issym():
            m.mode = mode
        out.addfile(m, tin.extractfile(m) if m.isfile() else None)
        n += 1
    return n


def build_template(c: Client, *, name: str, base: dict[str, str], steps: list[TemplateStep], lock_path: str,
                   start_cmd: str | None = None, ready_cmd: str | None = None, network: str | None = None,
                   store: str | None = None, deadline: float | None = None, force: bool = False,
                   cpu: float | None = None, memory_mb: int | None = None, say: Callable[[str], Any] | None = None,
                   on_output: Callable[[str, bytes], Any] | None = None,
                   on_step: Callable[[int], Any] | None = None) -> TemplateBuildResult:
    """Build E2B template ``steps`` over ``base`` (``{"image": REF}``, ``{"lock": PATH}`` or
    ``{"snapshot": ID}``); writes the lock to ``lock_path``. Blocks: a worker thread's call."""
    from ..plan import MAX_GROUPS, Lock, PlanError, apply_image_defaults, apply_overrides, plan_from_builtins, \
        plan_to_builtins, write_plan

    t0 = time.perf_counter()
    say = say or (lambda m: None)
    tb = _TemplateBuild(c, name, network=network, store=store or None, say=say, on_output=on_output,
                        deadline=deadline, force=force)
    st = tb.start(base)
    for i, step in enumerate(steps, start=1):
        if step.kind not in STEP_KINDS:
            raise BuildError(f"steps[{i - 1}].type: {step.kind!r} is not one of {', '.join(STEP_KINDS)}")
        if on_step is not None:
            on_step(i)
        tb.step(st, i, step)
    if on_step is not None:
        on_step(0)
    tb.finish(st)
    tb.check_ready(st, start_cmd, ready_cmd)
    base_lock = st.base_lock
    squash = st.snapshot is not None and len(base_lock.groups) + len(c.snapshot(st.snapshot).layers) > MAX_GROUPS
    built, uploaded = tb.b.publish(st, squash=squash, group="template", group_class="task",
                                   source=f"e2b template {name}")
    # a layer the lock has already (an empty diff, again: the same bytes) is left out, as overlayfs
    # refuses a lower directory twice; a template over a template: its groups' names go on counting
    seen = {g.layer_digest for g in base_lock.groups}
    unique = []
    for g in built:
        if g.layer_digest not in seen:
            seen.add(g.layer_digest)
            unique.append(g)
    n = len(base_lock.groups)
    built = [msgspec.structs.replace(g, name=f"tpl{n + i}") for i, g in enumerate(unique)]
    image = {"source": f"e2b-template:{name}", "entrypoint": st.entrypoint, "cmd": st.cmd,
             "ports": st.ports, "labels": st.labels, "stop_signal": st.stop_signal}
    data = plan_to_builtins(msgspec.structs.replace(base_lock, groups=[*base_lock.groups, *built],
                                                    env={**dict(base_lock.env), **st.env}, workdir=st.workdir,
                                                    user=st.user or None, image=None))
    try:
        lock = apply_image_defaults(plan_from_builtins(data, Lock, source=lock_path),
                                    {"image": {k: v for k, v in image.items() if v}})
        if cpu is not None or memory_mb is not None:  # E2B's cpuCount / memoryMB: the sandbox's resources
            lock = apply_overrides(lock, cpu=cpu, memory=None if memory_mb is None else f"{memory_mb}MiB")
    except (PlanError, ValueError) as e:
        raise BuildError(f"the built lock is not one weenv starts: {e}") from None
    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    write_plan(lock, lock_path)
    return TemplateBuildResult(lock_path, lock, [g.ref for g in built], uploaded, tb.b.steps,
                               time.perf_counter() - t0)
