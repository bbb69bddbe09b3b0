"""``weenv build``: FROM a plan, lock, image or snapshot, run steps, seal the result into a group.

    from = "base.lock.toml"            # a plan or lock file, a snapshot id, or "image:REF"
    context = "."                      # COPY sources are relative to it (default: the spec's folder)
    [group]
    name = "toolchain"
    class = "toolchain"
    [[steps]]
    run = "apk add gcc"                # /bin/sh -c, with the ENV/WORKDIR/USER set so far
    [[steps]]
    copy = { src = "src/", dest = "/app/src" }
    [[steps]]
    env = { PATH = "/opt/bin:/usr/bin:/bin" }

Each RUN and COPY step runs in an env started from the previous step's snapshot and is committed
into a new snapshot; a step whose inputs (parent, step text, ENV/WORKDIR/USER, copied files) are
unchanged is taken from the build cache, as Docker does. Only when every step succeeded are the
step layers squashed into one group layer, published, and a plan lock written.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from .. import _home, layerfmt
from .._atomic import atomic_write
from .._client import Client, Env, WeenvError

STEP_KINDS = ("run", "env", "workdir", "user", "copy")


class BuildError(WeenvError):
    """Raised when a build spec is invalid or a step fails; names the step."""


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class CopyStep(_Strict):
    src: str
    dest: str
    mode: int | None = None


class Step(_Strict):
    run: str | None = None
    env: dict[str, str] | None = None
    workdir: str | None = None
    user: str | None = None
    copy: CopyStep | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None

    def kind(self) -> str:
        kinds = [k for k in STEP_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(f"a step needs exactly one of {', '.join(STEP_KINDS)} (got {kinds or 'none'})")
        return kinds[0]


class GroupOut(_Strict):
    name: str = "build"
    group_class: Literal["os", "toolchain", "harness", "evaluator", "task"] = msgspec.field(name="class",
                                                                                             default="toolchain")


class BuildSpec(_Strict):
    from_: str = msgspec.field(name="from")
    context: str | None = None
    # the network of RUN steps: "host" lets them download (pip, apt); the result keeps the base's network
    network: Literal["none", "loopback", "host"] | None = None
    group: GroupOut = msgspec.field(default_factory=GroupOut)
    steps: list[Step] = []


@dataclass
class StepResult:
    index: int
    kind: str
    cached: bool
    seconds: float
    snapshot: str | None


@dataclass
class BuildResult:
    ref: str
    digest: str
    toc_digest: str
    layer_digest: str
    lock: str
    snapshot: str
    uploaded_bytes: int
    steps: list[StepResult] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"ref": self.ref, "digest": self.digest, "toc_digest": self.toc_digest,
                "layer_digest": self.layer_digest, "lock": self.lock, "snapshot": self.snapshot,
                "uploaded_bytes": self.uploaded_bytes,
                "steps": [s.__dict__ for s in self.steps]}


def load_spec(path: str) -> BuildSpec:
    import tomllib

    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise BuildError(f"cannot read build spec {path}: {e.strerror}") from None
    try:
        data = json.loads(raw) if path.endswith(".json") else tomllib.loads(raw.decode("utf-8"))
        spec = msgspec.convert(data, BuildSpec)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise BuildError(f"{path}: {e}") from None
    except msgspec.ValidationError as e:
        raise BuildError(f"{path}: {e}") from None
    for i, step in enumerate(spec.steps):
        try:
            step.kind()
        except ValueError as e:
            raise BuildError(f"{path}: steps[{i}]: {e}") from None
    return spec


def _sha(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _copy_files(context: str, src: str) -> list[tuple[str, str, int]]:
    """(absolute host path, path relative to the copy source, mode) of every file to copy, sorted."""
    root = os.path.realpath(context)
    full = os.path.realpath(os.path.join(root, src))
    if full != root and not full.startswith(root + os.sep):
        raise BuildError(f"COPY source {src!r} is outside the build context {context}")
    if not os.path.exists(full):
        raise BuildError(f"COPY source {src!r} does not exist in the build context {context}")
    if os.path.isfile(full):
        return [(full, os.path.basename(full), os.stat(full).st_mode & 0o7777)]
    out = []
    for dirpath, dirnames, filenames in os.walk(full):
        dirnames.sort()
        for name in sorted(filenames):
            p = os.path.join(dirpath, name)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            out.append((p, os.path.relpath(p, full), os.stat(p).st_mode & 0o7777))
    return out


def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class StepCache:
    """Step key → snapshot id, one small file per key under ``$WEENV_HOME/cache/steps``.

    One file per key (written temp + rename) so that concurrent builds, threads of ``weenv package``
    or separate processes, never lose each other's entries.
    """

    def __init__(self, root: str | None = None):
        self.root = root or os.path.join(_home.home(), "cache", "steps")

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def get(self, key: str) -> str | None:
        try:
            with open(self._path(key), encoding="utf-8") as f:
                snap = f.read().strip()
        except OSError:
            return None
        return snap if snap.startswith("snap-") else None

    def put(self, key: str, snap: str) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
            atomic_write(self._path(key), snap, mode=None, fsync=False)
        except OSError:
            pass  # the cache only saves time


def _tail(data: bytes, n: int = 2000) -> str:
    return data[-n:].decode("utf-8", "replace")


class StepFailedError(BuildError):
    """Raised when a RUN step exits non-zero; carries the exit code and the tail of its output."""

    def __init__(self, message: str, *, index: int, exit_code: int, output_tail: str, timed_out: bool):
        super().__init__(message)
        self.index, self.exit_code, self.output_tail, self.timed_out = index, exit_code, output_tail, timed_out


@dataclass
class StepsOutcome:
    """Where :func:`run_steps` left the build: the last snapshot and the ENV/WORKDIR/USER in force."""

    key: str
    snapshot: str | None
    env_vars: dict[str, str]
    workdir: str | None
    user: str | None
    steps: list[StepResult]

    @property
    def created_snapshots(self) -> list[str]:
        """Snapshots this run made (not taken from the cache)."""
        return [s.snapshot for s in self.steps if not s.cached and s.snapshot and s.kind in ("run", "copy")]


def _step_label(i: int, step: Step) -> str:
    return f"step {i + 1} ({step.kind()} {step.run!r})" if step.run is not None else f"step {i + 1} ({step.kind()})"


def base_key(lock: Any) -> str:
    """The cache key of starting from a plan lock: its pinned layers and how it runs."""
    return _sha("lock", [(g.digest, g.layer_digest) for g in lock.groups])


def run_steps(c: Client, steps: list[Step], *, start: dict[str, Any] | str, key: str, context: str | None = None,
              cache: StepCache | None = None, say: Callable[[str], Any] | None = None,
              label: Callable[[int, Step], str] = _step_label,
              on_step: Callable[[int, Step], Any] | None = None, network: str | None = None) -> StepsOutcome:
    """Run ``steps`` from ``start`` (a plan/lock as builtins, or a snapshot id), one env per RUN/COPY step.

    ``key`` identifies the start; each step's cache key chains it with the step and the
    ENV/WORKDIR/USER in force (and the copied files' digests), so an unchanged prefix of steps is
    taken from ``cache`` as long as its snapshot still exists. A failing RUN raises
    :class:`StepFailedError` (named by ``label``); no env is left running either way.
    """
    say = say or (lambda msg: None)
    cache = cache or StepCache()
    current_snapshot: str | None = start if isinstance(start, str) else None
    env_vars: dict[str, str] = {}
    workdir: str | None = None
    user: str | None = None
    results: list[StepResult] = []

    def start_env() -> Env:
        return c.create(current_snapshot if current_snapshot is not None else start, network=network)

    for i, step in enumerate(steps):
        kind = step.kind()
        if on_step is not None:
            on_step(i, step)
        t0 = time.perf_counter()
        if kind in ("env", "workdir", "user"):
            if kind == "env":
                env_vars.update(step.env or {})
            elif kind == "workdir":
                workdir = step.workdir
            else:
                user = step.user
            key = _sha(key, i, kind, msgspec.to_builtins(step))
            results.append(StepResult(i, kind, True, 0.0, current_snapshot))
            continue
        files: list[tuple[str, str, int]] = []
        if kind == "copy":
            assert step.copy is not None
            if context is None:
                raise BuildError(f"{label(i, step)}: COPY needs a build context")
            files = _copy_files(context, step.copy.src)
            key = _sha(key, i, kind, msgspec.to_builtins(step), [(rel, mode, _file_digest(p)) for p, rel, mode in files])
        else:
            key = _sha(key, i, kind, step.run, env_vars, workdir, user, *([network] if network else []))
        cached = cache.get(key)
        if cached is not None:
            try:
                c.snapshot(cached)
                current_snapshot = cached
                results.append(StepResult(i, kind, True, time.perf_counter() - t0, cached))
                say(f"step {i + 1}/{len(steps)} {kind}: cached ({cached})")
                continue
            except WeenvError:
                pass  # the cached snapshot was deleted: build the step again
        env = start_env()
        try:
            if kind == "run":
                assert step.run is not None
                r = env.exec(["/bin/sh", "-c", step.run], env=env_vars or None, cwd=workdir, user=user,
                             timeout_s=step.timeout_s)
                if r.exit_code != 0:
                    detail = _tail(r.stdout + r.stderr)
                    raise StepFailedError(
                        f"{label(i, step)} failed with exit code {r.exit_code}"
                        f"{' (timed out)' if r.timed_out else ''}; output tail:\n{detail}",
                        index=i, exit_code=r.exit_code, output_tail=detail, timed_out=r.timed_out)
            else:
                assert step.copy is not None and context is not None
                dest = step.copy.dest
                single = len(files) == 1 and os.path.isfile(os.path.join(context, step.copy.src))
                for host_path, rel, mode in files:
                    target = dest if single and not dest.endswith("/") else os.path.join(dest, rel)
                    with open(host_path, "rb") as f:
                        env.write_file(target, f.read(), mode=step.copy.mode or mode, user=user)
            current_snapshot = env.commit()
        finally:
            env.kill()
        cache.put(key, current_snapshot)
        results.append(StepResult(i, kind, False, time.perf_counter() - t0, current_snapshot))
        say(f"step {i + 1}/{len(steps)} {kind}: done in {time.perf_counter() - t0:.1f}s ({current_snapshot})")
    return StepsOutcome(key, current_snapshot, env_vars, workdir, user, results)


def locked_group(pub: Any, *, name: str, group_class: str) -> Any:
    """The lock entry of a group just published (``pub``: a registry PublishResult)."""
    from ..plan import LockedGroup
    from ..registry import parse_ref

    r = parse_ref(pub.ref)
    return LockedGroup(name=name, ref=pub.ref, group_class=group_class, digest=pub.digest,
                       layer_digest=pub.layer_digest, layer_size=pub.size, toc_digest=pub.toc_digest,
                       registry=r.registry, repo=r.repo)


def check_group_placement(base: Any, group: GroupOut, *, spec_path: str, frm: str) -> None:
    """Refuse, before anything runs, a group class that cannot go where a build puts the group.

    The built layer is the diff over every group of the base, so it goes on top of them in the lock
    the build writes; lock order is by class, bottom first (os, toolchain, harness, evaluator, task).
    A group whose class ranks below a group of the base would make a lock that weenv refuses.
    """
    from ..plan import GROUP_CLASSES

    rank = GROUP_CLASSES.index(group.group_class)
    kept = [(i, g) for i, g in enumerate(base.groups) if g.name != group.name]  # a same-named group is replaced
    higher = [(i, g) for i, g in kept if GROUP_CLASSES.index(g.group_class) > rank]
    if not higher:
        return
    i, top = max(higher, key=lambda x: GROUP_CLASSES.index(x[1].group_class))
    allowed = ", ".join(repr(c) for c in GROUP_CLASSES[GROUP_CLASSES.index(top.group_class):])
    raise BuildError(
        f"{spec_path}: group.class = {group.group_class!r} cannot be built FROM {frm!r}: its groups[{i}] "
        f"({top.name}) is class {top.group_class!r}, and a built group goes on top of the groups it was built "
        f"over (a lock lists classes bottom first: {', '.join(GROUP_CLASSES)}). Either give the built group "
        f"class {allowed}, or build it FROM a plan or lock without the groups of classes above "
        f"{group.group_class!r} and list those after the built group in your plan."
    )


def build(spec_path: str, *, ref: str | None = None, lock_out: str | None = None, client: Client | None = None,
          log: Any = None) -> BuildResult:
    """Run a build spec; returns the published group and the written plan lock."""
    from ..plan import Lock, PlanError, load_any, lock_plan, plan_from_builtins, plan_to_builtins, write_plan
    from ..registry import publish_layer_file, resolve_group

    spec = load_spec(spec_path)
    spec_dir = os.path.dirname(os.path.abspath(spec_path))
    context = os.path.join(spec_dir, spec.context) if spec.context else spec_dir
    say = log or (lambda msg: None)
    own_client = client is None
    c = client or Client()
    try:
        # ---- FROM
        base_lock: Lock | None
        start: dict[str, Any] | str
        frm = spec.from_
        if frm.startswith("snap-"):
            snap_info = c.snapshot(frm)
            base_lock = None  # the snapshot's own lock, read at the end
            check_group_placement(msgspec.convert(snap_info.lock, Lock), spec.group, spec_path=spec_path, frm=frm)
            start = frm
            start_key = _sha("snapshot", frm, snap_info.layers)
        else:
            if frm.startswith("image:"):
                from ..plan import Group, Plan

                plan = Plan(name=spec.group.name, groups=[Group(name="os", ref=frm[6:], group_class="os")])
            else:
                path = frm if os.path.isabs(frm) else os.path.join(spec_dir, frm)
                plan = load_any(path)
            check_group_placement(plan, spec.group, spec_path=spec_path, frm=frm)
            base_lock = plan if isinstance(plan, Lock) else lock_plan(plan, resolve_group)
            start_key = base_key(base_lock)
            start = msgspec.to_builtins(base_lock)

        # ---- steps
        done = run_steps(c, spec.steps, start=start, key=_sha("from", start_key), context=context, say=say,
                         network=spec.network)
        if done.snapshot is None:
            raise BuildError(f"{spec_path}: no RUN or COPY step: nothing to seal into a group")

        # ---- squash the step layers into one group layer, publish, lock
        snap = c.snapshot(done.snapshot)
        if base_lock is None:  # FROM a snapshot: its plan lock is the base, its own layers get squashed too
            base_lock = msgspec.convert(snap.lock, Lock)
        target_ref = ref or f"{spec.group.name}:build"
        with tempfile.TemporaryDirectory(dir=tmp_dir()) as tmp:
            out_path = os.path.join(tmp, "group.weenv")
            digest = squash_layers([x["digest"] for x in snap.layers], out_path, tmp)
            pub = publish_layer_file(out_path, target_ref, group=spec.group.name, group_class=spec.group.group_class,
                                     digest=digest, source=f"weenv build {os.path.basename(spec_path)}")
        g = resolve_group(target_ref)
        from ..plan import LockedGroup

        new_group = LockedGroup(name=spec.group.name, ref=target_ref, group_class=spec.group.group_class,
                                digest=g.manifest_digest, layer_digest=g.layer_digest, layer_size=g.layer_size,
                                toc_digest=g.toc_digest, registry=g.registry, repo=g.repo)
        groups = [x for x in base_lock.groups if x.name != spec.group.name] + [new_group]
        merged_env = {**base_lock.env, **done.env_vars}
        workdir = done.workdir or base_lock.workdir
        if workdir and workdir.startswith("/"):  # cleaned as Docker cleans WORKDIR: "/app/" is "/app"
            from ..plan._validate import normalised_path

            workdir = normalised_path(workdir)
        out_lock = msgspec.structs.replace(base_lock, groups=groups, env=merged_env,
                                           workdir=workdir, user=done.user or base_lock.user)
        lock_path = lock_out or os.path.join(spec_dir, f"{os.path.splitext(os.path.basename(spec_path))[0]}.lock.toml")
        try:  # never write a lock that weenv would refuse to start from
            out_lock = plan_from_builtins(plan_to_builtins(out_lock), Lock, source=lock_path)
        except PlanError as e:
            raise BuildError(f"{spec_path}: the built group {target_ref} was published, but the lock it makes is "
                             f"invalid, so it was not written:\n{e}") from None
        write_plan(out_lock, lock_path)
        return BuildResult(ref=target_ref, digest=pub.digest, toc_digest=pub.toc_digest, layer_digest=pub.layer_digest,
                           lock=lock_path, snapshot=done.snapshot, uploaded_bytes=pub.uploaded_bytes, steps=done.steps)
    finally:
        if own_client:
            c.close()


def tmp_dir() -> str | None:
    """``$WEENV_HOME/tmp`` (same filesystem as the embedded store), or None for the system default."""
    d = os.path.join(_home.home(), "tmp")
    try:
        os.makedirs(d, exist_ok=True)
        return d
    except OSError:
        return None


def squash_layers(digests: list[str], out_path: str, tmp: str) -> str:
    """Merge layers of the embedded store (bottom first, OCI whiteouts kept for what lies below)
    into one group layer at ``out_path``; returns its digest."""
    from ..registry import LayoutStore
    from ..registry._image import squash

    store = LayoutStore(_home.store_dir())
    spools = []
    layers = []
    try:
        for d in digests:
            with open(store.blob_path(d), "rb") as f:
                entries, spool = layerfmt.scan_tar(f, spool_dir=tmp)
            spools.append(spool)
            layers.append(entries)
        merged = squash(layers, bottom=False)
        with open(out_path, "wb") as out:
            res = layerfmt.build_entries(merged, out)
        return res.digest
    finally:
        for s in spools:
            s.close()

