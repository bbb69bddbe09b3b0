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
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from . import _home, layerfmt
from ._client import Client, Env, WeenvError

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


class _Cache:
    def __init__(self, path: str):
        self.path = path
        try:
            with open(path) as f:
                self.data: dict[str, str] = json.load(f)
        except (OSError, ValueError):
            self.data = {}

    def get(self, key: str) -> str | None:
        return self.data.get(key)

    def put(self, key: str, snap: str) -> None:
        self.data[key] = snap
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


def _tail(data: bytes, n: int = 2000) -> str:
    return data[-n:].decode("utf-8", "replace")


def build(spec_path: str, *, ref: str | None = None, lock_out: str | None = None, client: Client | None = None,
          log: Any = None) -> BuildResult:
    """Run a build spec; returns the published group and the written plan lock."""
    from .plan import Lock, LockedGroup, load_any, lock_plan, write_plan
    from .registry import publish_layer_file, resolve_group

    spec = load_spec(spec_path)
    spec_dir = os.path.dirname(os.path.abspath(spec_path))
    context = os.path.join(spec_dir, spec.context) if spec.context else spec_dir
    say = log or (lambda msg: None)
    own_client = client is None
    c = client or Client()
    cache = _Cache(os.path.join(_home.home(), "cache", "build.json"))
    try:
        # ---- FROM
        base_lock: Lock | None
        current_snapshot: str | None = None
        frm = spec.from_
        if frm.startswith("snap-"):
            snap_info = c._request("GET", f"/v1/snapshots/{frm}").json()
            base_lock = None  # the snapshot's own lock, read at the end
            current_snapshot = frm
            base_key = _sha("snapshot", frm, snap_info["layers"])
            base_plan: Any = frm
        else:
            if frm.startswith("image:"):
                from .plan import Group, Plan

                plan = Plan(name=spec.group.name, groups=[Group(name="os", ref=frm[6:], group_class="os")])
            else:
                path = frm if os.path.isabs(frm) else os.path.join(spec_dir, frm)
                plan = load_any(path)
            base_lock = plan if isinstance(plan, Lock) else lock_plan(plan, resolve_group)
            base_key = _sha("lock", [(g.digest, g.layer_digest) for g in base_lock.groups])
            base_plan = msgspec.to_builtins(base_lock)
        key = _sha("from", base_key)
        env_vars: dict[str, str] = {}
        workdir: str | None = None
        user: str | None = None
        results: list[StepResult] = []

        def start_env() -> Env:
            if current_snapshot is not None:
                return c.create(current_snapshot)
            return c.create(base_plan)

        # ---- steps
        for i, step in enumerate(spec.steps):
            kind = step.kind()
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
                files = _copy_files(context, step.copy.src)
                key = _sha(key, i, kind, msgspec.to_builtins(step), [(rel, mode, _file_digest(p)) for p, rel, mode in files])
            else:
                key = _sha(key, i, kind, step.run, env_vars, workdir, user)
            cached = cache.get(key)
            if cached is not None:
                try:
                    c._request("GET", f"/v1/snapshots/{cached}")
                    current_snapshot = cached
                    results.append(StepResult(i, kind, True, time.perf_counter() - t0, cached))
                    say(f"step {i + 1}/{len(spec.steps)} {kind}: cached ({cached})")
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
                        raise BuildError(f"step {i + 1} (run {step.run!r}) failed with exit code {r.exit_code}"
                                         f"{' (timed out)' if r.timed_out else ''}; output tail:\n{detail}")
                else:
                    assert step.copy is not None
                    dest = step.copy.dest
                    single = len(files) == 1 and os.path.isfile(os.path.join(context, step.copy.src))
                    for host_path, rel, mode in files:
                        target = dest if single and not dest.endswith("/") else os.path.join(dest, rel)
                        with open(host_path, "rb") as f:
                            env.write_file(target, f.read(), mode=step.copy.mode or mode, user=user)
                current_snapshot = c._request("POST", f"/v1/envs/{env.id}/commit", json={}).json()["snapshot"]
            finally:
                env.kill()
            cache.put(key, current_snapshot)
            results.append(StepResult(i, kind, False, time.perf_counter() - t0, current_snapshot))
            say(f"step {i + 1}/{len(spec.steps)} {kind}: done in {time.perf_counter() - t0:.1f}s ({current_snapshot})")
        if current_snapshot is None:
            raise BuildError(f"{spec_path}: no RUN or COPY step: nothing to seal into a group")

        # ---- squash the step layers into one group layer, publish, lock
        snap = c._request("GET", f"/v1/snapshots/{current_snapshot}").json()
        if base_lock is None:  # FROM a snapshot: its plan lock is the base, its own layers get squashed too
            base_lock = msgspec.convert(snap["lock"], Lock)
        target_ref = ref or f"{spec.group.name}:build"
        with tempfile.TemporaryDirectory(dir=os.path.join(_home.home(), "tmp") if _ensure_tmp() else None) as tmp:
            out_path = os.path.join(tmp, "group.weenv")
            digest = _squash_layers([x["digest"] for x in snap["layers"]], out_path, tmp)
            pub = publish_layer_file(out_path, target_ref, group=spec.group.name, group_class=spec.group.group_class,
                                     digest=digest, source=f"weenv build {os.path.basename(spec_path)}")
        g = resolve_group(target_ref)
        new_group = LockedGroup(name=spec.group.name, ref=target_ref, group_class=spec.group.group_class,
                                digest=g.manifest_digest, layer_digest=g.layer_digest, layer_size=g.layer_size,
                                toc_digest=g.toc_digest, registry=g.registry, repo=g.repo)
        groups = [x for x in base_lock.groups if x.name != spec.group.name] + [new_group]
        merged_env = {**base_lock.env, **env_vars}
        out_lock = msgspec.structs.replace(base_lock, groups=groups, env=merged_env,
                                           workdir=workdir or base_lock.workdir, user=user or base_lock.user)
        lock_path = lock_out or os.path.join(spec_dir, f"{os.path.splitext(os.path.basename(spec_path))[0]}.lock.toml")
        write_plan(out_lock, lock_path)
        return BuildResult(ref=target_ref, digest=pub.digest, toc_digest=pub.toc_digest, layer_digest=pub.layer_digest,
                           lock=lock_path, snapshot=current_snapshot, uploaded_bytes=pub.uploaded_bytes, steps=results)
    finally:
        if own_client:
            c.close()


def _ensure_tmp() -> bool:
    try:
        os.makedirs(os.path.join(_home.home(), "tmp"), exist_ok=True)
        return True
    except OSError:
        return False


def _squash_layers(digests: list[str], out_path: str, tmp: str) -> str:
    """Merge snapshot layers (bottom first, OCI whiteouts applied) into one group layer; returns its digest."""
    from .registry import LayoutStore
    from .registry._image import squash

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
