"""Docker's ``POST /build`` (``images.build(fileobj=/path=, tag=, dockerfile=, buildargs=)``):
the request body is a tar of the build context; weenv's Dockerfile builder
(weenv/build/_dockerbuild.py, the code of ``weenv build -f``) builds it, and the lock it makes is
recorded as an image of the key's (weenv/api/_docker_images.py), tagged with the ``t``s.

The context is received into a temporary directory of the server (at most
:data:`MAX_CONTEXT_BYTES`, received and unpacked: a 413 naming the limit beyond), unpacked with
tarfile's ``data`` filter (no absolute names, no ``..``, no device nodes, no links out). The
build runs in a worker thread under the server's task group (a client that goes away stops it at
its next step or line of output), at most :data:`CONCURRENT_BUILDS` at once; its progress is dockerd's JSON lines
(``{"stream": "Step 1/3 : FROM ..."}``, RUN's output, ``{"aux": {"ID": ...}}``,
``Successfully built``/``tagged``; a failure ``{"errorDetail": ..., "error": ...}``).

For a key that is not an admin's, what a ``FROM`` (or ``COPY --from``) may name is what its
container create may: a registry REF in a listed registry, or an image of its own (a tag or id:
its commit's snapshot or its build's lock); never a path, a snapshot or a group ref of the node.
Its RUN steps get the loopback network only (as an E2B template build's), and its steps are
cached apart from every other key's.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import os
import posixpath
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ._common import HttpError, key_of, log, state_of
from ._docker import not_supported
from ._docker_containers import _flag, docker_state
from ._docker_images import _line, normalized, own_images, remember, tag_ref
from ._store import ApiKey

MAX_CONTEXT_BYTES = int(os.environ.get("WEENV_DOCKER_BUILD_CONTEXT_BYTES", str(256 << 20)))
"""The most bytes of a build context, as sent and as unpacked (``$WEENV_DOCKER_BUILD_CONTEXT_BYTES``)."""
BUILD_TIMEOUT_S = float(os.environ.get("WEENV_DOCKER_BUILD_TIMEOUT_S", "1800"))
CONCURRENT_BUILDS = 2
_DRAIN_BYTES = 64 << 20
"""A context this much over the limit is still read (and dropped) before the 413, so that a client
that sends it whole (docker-py does) gets the answer; beyond that, the 413 comes at once."""


class BuildGone(Exception):
    """The client went away: the build stops at its next step (its env killed)."""


def _json_param(request: Request, name: str) -> dict[str, str]:
    text = request.query_params.get(name)
    if not text:
        return {}
    try:
        got = msgspec.json.decode(text, type=dict[str, str | None])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HttpError(400, "bad_request", f"{name}: a JSON object of strings ({e})") from None
    return {k: v for k, v in got.items() if v is not None}


def _dockerfile_path(request: Request) -> str:
    """``dockerfile``: a path inside the context (relative; no ``..``)."""
    name = request.query_params.get("dockerfile") or "Dockerfile"
    norm = posixpath.normpath(name.lstrip("/")) if name.strip("/") else ""
    if not norm or norm == "." or norm == ".." or norm.startswith("../") or "\x00" in norm:
        raise HttpError(400, "bad_request", f"dockerfile {name[:200]!r}: a path inside the build context")
    return norm


def _network(request: Request, key: ApiKey) -> str | None:
    mode = request.query_params.get("networkmode") or "default"
    if mode == "host" and not key.admin:
        raise HttpError(403, "forbidden", "networkmode \"host\" (the node's own network) needs an admin key")
    if mode not in ("default", "bridge", "none", "host"):
        raise not_supported(f"POST /build networkmode {mode[:100]!r} (default, bridge, none and host are)")
    if mode == "none":
        return "none"
    if mode == "host":
        return "host"
    return None if key.admin else "loopback"


async def _receive(request: Request, into: str) -> None:
    """The request body (the context tar) into the file ``into``, at most MAX_CONTEXT_BYTES."""
    limit = MAX_CONTEXT_BYTES
    length = request.headers.get("content-length")
    too_big = HttpError(413, "too_large", f"the build context is larger than this server takes ({limit} bytes; "
                        "the operator sets $WEENV_DOCKER_BUILD_CONTEXT_BYTES): leave out what the build does not "
                        "need (.dockerignore)")
    if length is not None and length.isdigit() and int(length) > limit + _DRAIN_BYTES:
        raise too_big
    got = 0
    with open(into, "wb") as f:
        async for chunk in request.stream():
            got += len(chunk)
            if got > limit + _DRAIN_BYTES:
                raise too_big
            if got <= limit:
                f.write(chunk)
    if got > limit:  # read to its end (not kept): a client still sending would not see the answer
        raise too_big
    if not got:
        raise HttpError(400, "bad_request", "the request body (the build context, a tar) is empty")


def _unpack(tar_path: str, into: str) -> None:
    """The context tar (plain, gzip, bzip2 or xz) unpacked with tarfile's ``data`` filter; blocks."""
    try:
        with tarfile.open(tar_path, mode="r:*") as tar:
            total = 0
            for m in tar:
                total += m.size
                if total > MAX_CONTEXT_BYTES:
                    raise HttpError(413, "too_large", f"the build context unpacks to more than {MAX_CONTEXT_BYTES} "
                                    "bytes (the operator sets $WEENV_DOCKER_BUILD_CONTEXT_BYTES)")
                try:
                    tar.extract(m, into, filter="data")
                except tarfile.FilterError as e:
                    raise HttpError(400, "bad_request", f"build context member {m.name[:200]!r}: {e}") from None
    except (tarfile.TarError, EOFError, OSError) as e:
        raise HttpError(400, "bad_request", f"the build context is not a tar archive weenv can read ({e})"[:500]) \
            from None


def _ref_checker(request: Request, key: ApiKey, work: str) -> Any:
    """``check_ref`` of the build: the key's own image names first (its commit's snapshot, its
    build's lock written to ``work``), then, for a non-admin key, a registry REF it may name."""
    from ..build import DockerfileError
    from ..plan import Lock, plan_from_builtins, write_plan
    from ..registry import is_image_ref
    from ._tenant import check_image

    state = state_of(request)
    own = list(own_images(request))  # read here, on the event loop: the worker thread reads the copy

    def check(ref: str, where: str) -> str | None:
        rec = next((r for want in dict.fromkeys((ref, normalized(ref))) for r in own if want in r.refs), None) \
            or next((r for r in own if r.id == ref or r.id.removeprefix("sha256:").startswith(ref.removeprefix(
                "sha256:")) and len(ref.removeprefix("sha256:")) >= 12), None)
        if rec is not None:
            if "snapshot" in rec.origin:
                return str(rec.origin["snapshot"])
            if "plan" in rec.origin:
                path = os.path.join(work, f"from-{rec.id.removeprefix('sha256:')[:16]}.lock.toml")
                write_plan(plan_from_builtins(rec.origin["plan"], Lock, source=f"image {rec.id}"), path)
                return path
            ref = str(rec.origin["image"])
        if key.admin:
            return ref
        if not is_image_ref(ref) or ref.startswith(("oci:", "docker-archive:")):
            raise DockerfileError(f"{where} {ref[:200]!r}: an API key that is not an admin's builds from a registry "
                                  "image (host[:port]/repo:tag) or an image of its own, not from the node's files, "
                                  "snapshots or groups")
        try:
            check_image(state, key, ref)
        except HttpError as e:
            raise DockerfileError(f"{where}: {e.message}") from None
        return ref

    return check


def _image_doc(lock: Any, labels: dict[str, str], history: list[str]) -> dict[str, Any]:
    from ._docker import _arch

    img = lock.image
    created = dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")
    config = {"Env": [f"{k}={v}" for k, v in dict(lock.env).items()] or None,
              "Cmd": list(img.cmd) if img and img.cmd else None,
              "Entrypoint": list(img.entrypoint) if img and img.entrypoint else None,
              "WorkingDir": lock.workdir or "", "User": lock.user or "",
              "Labels": {**(dict(img.labels) if img else {}), **labels} or None,
              "ExposedPorts": {p: {} for p in img.ports} if img and img.ports else None}
    if img and img.stop_signal:
        config["StopSignal"] = img.stop_signal
    return {"architecture": _arch(), "os": "linux", "created": created, "config": config,
            "rootfs": {"type": "layers", "diff_ids": [g.layer_digest for g in lock.groups if g.layer_digest]},
            "history": [{"created": created, "created_by": h} for h in history]}


async def build(request: Request, params: dict[str, str]) -> Response:
    from ..build._build import tmp_dir

    state, key = state_of(request), key_of(request)
    q = request.query_params
    if q.get("remote"):
        raise not_supported("POST /build?remote= (a context fetched from a URL: send it as the body)")
    tags = [tag_ref(t, "", "t") for t in q.getlist("t")]
    dockerfile = _dockerfile_path(request)
    build_args, labels = _json_param(request, "buildargs"), _json_param(request, "labels")
    network, quiet = _network(request, key), _flag(request, "q")
    no_cache = _flag(request, "nocache")
    target = q.get("target") or None
    socket = state.backend.any().target
    if socket.startswith(("http://", "https://")):
        raise not_supported("POST /build on a server that is not next to its daemon (its socket)")
    work = tempfile.mkdtemp(prefix="docker-build-", dir=tmp_dir())
    handed_over = False
    try:
        context = os.path.join(work, "context")
        os.mkdir(context, 0o700)
        await _receive(request, os.path.join(work, "context.tar"))
        await anyio.to_thread.run_sync(_unpack, os.path.join(work, "context.tar"), context)
        os.unlink(os.path.join(work, "context.tar"))
        path = os.path.join(context, *dockerfile.split("/"))
        if not os.path.isfile(path) or os.path.islink(path):
            raise HttpError(400, "bad_request", f"Cannot locate specified Dockerfile: {dockerfile}")
        job = _Job(request, key, work, context, path, tags=tags, build_args=build_args, labels=labels,
                   network=network, quiet=quiet, no_cache=no_cache, target=target, socket=socket)
        handed_over = True
    finally:
        if not handed_over:
            shutil.rmtree(work, ignore_errors=True)
    return StreamingResponse(job.lines(), 200, media_type="application/json")


class _Job:
    """One build: its worker thread, the lines it sends, and its end."""

    def __init__(self, request: Request, key: ApiKey, work: str, context: str, dockerfile: str, *, tags: list[str],
                 build_args: dict[str, str], labels: dict[str, str], network: str | None, quiet: bool,
                 no_cache: bool, target: str | None, socket: str):
        self.request, self.state, self.key = request, state_of(request), key
        self.work, self.context, self.dockerfile = work, context, dockerfile
        self.tags, self.build_args, self.labels, self.network = tags, build_args, labels, network
        self.quiet, self.no_cache, self.target, self.socket = quiet, no_cache, target, socket
        self.check_ref = _ref_checker(request, key, work)  # on the event loop: it reads the key's records
        self.gone = threading.Event()
        self.history: list[str] = []
        self.send, self.receive = anyio.create_memory_object_stream[bytes](math.inf)

    # -- the worker thread

    def _emit(self, doc: dict[str, Any]) -> None:
        if self.gone.is_set():
            raise BuildGone()
        try:
            anyio.from_thread.run_sync(self.send.send_nowait, _line(doc))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.gone.set()
            raise BuildGone() from None

    def _say(self, text: str) -> None:
        if not self.quiet:
            self._emit({"stream": text})

    def _blocking(self) -> Any:
        from .. import Client, _home
        from ..build import build_dockerfile
        from ..build._dockerfile import parse

        with open(self.dockerfile, encoding="utf-8", errors="replace") as f:
            df = parse(f.read(), os.path.relpath(self.dockerfile, self.context))
        stages = df.stages if self.target is None else \
            df.stages[:next((s.index + 1 for s in df.stages if s.name == self.target.lower()), len(df.stages))]
        total = sum(1 + len(s.instructions) for s in stages)
        step = [0]

        def on_instruction(stage: Any, ins: Any) -> None:
            step[0] += 1
            text = f"FROM {stage.base}" + (f" AS {stage.name}" if stage.name else "") if ins is None \
                else f"{ins.op} {ins.value}"
            self.history.append(text)
            self._say(f"Step {step[0]}/{total} : {text}\n")

        def on_output(stream: str, data: bytes) -> None:
            self._say(data.decode("utf-8", "replace"))

        with Client(self.socket, autostart=False, timeout_s=BUILD_TIMEOUT_S + 60) as c:
            return build_dockerfile(
                self.dockerfile, self.context, output=os.path.join(self.work, "built.lock.toml"),
                name=(self.tags[0].rsplit("/", 1)[-1].split(":", 1)[0] if self.tags else "docker-build"),
                build_args=self.build_args, target=self.target, network=self.network, client=c,
                log=lambda m: self._say(f" ---> {m.split(': ', 1)[-1]}\n"),
                check_ref=self.check_ref, on_instruction=on_instruction,
                on_output=on_output, deadline=time.monotonic() + BUILD_TIMEOUT_S, no_cache=self.no_cache,
                cache_root=os.path.join(_home.home(), "cache", "docker-steps", self.key.id))

    # -- the event loop

    async def _run(self) -> None:
        from ..build import BuildError, StepFailedError

        ds = docker_state(self.state)
        if ds.build_slots is None:
            ds.build_slots = anyio.CapacityLimiter(CONCURRENT_BUILDS)
        error: dict[str, Any] | None = None
        try:
            async with ds.build_slots:
                result = await anyio.to_thread.run_sync(self._blocking, abandon_on_cancel=True)
            self._finish(result)
        except BuildGone:
            log.info("docker: build in %s stopped: its client went away", self.work)
        except StepFailedError as e:
            error = {"errorDetail": {"code": e.exit_code, "message": str(e)}, "error": str(e)}
        except BuildError as e:
            error = {"errorDetail": {"message": str(e)}, "error": str(e)}
        except HttpError as e:
            error = {"errorDetail": {"message": e.message}, "error": e.message}
        except Exception as e:  # noqa: BLE001 - the stream says how the build ended, whatever went wrong
            log.exception("docker: build in %s failed", self.work)
            error = {"errorDetail": {"message": f"the build failed: {type(e).__name__}: {e}"},
                     "error": f"the build failed: {type(e).__name__}: {e}"}
        finally:
            if error is not None:
                try:
                    self.send.send_nowait(_line(error))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass
            self.send.close()
            shutil.rmtree(self.work, ignore_errors=True)

    def _finish(self, result: Any) -> None:
        from ..plan import plan_to_builtins

        lock = result.lock
        doc = _image_doc(lock, self.labels, self.history)
        image_id = "sha256:" + hashlib.sha256(msgspec.json.encode(doc)).hexdigest()
        origin = {"plan": plan_to_builtins(lock)}
        size = sum(int(g.layer_size or 0) for g in lock.groups)
        ds = docker_state(self.state)
        remember(ds, self.key, None, image_id, doc, size, origin=origin)
        for t in self.tags:
            remember(ds, self.key, t, image_id, doc, size, origin=origin)
        short = image_id.removeprefix("sha256:")[:12]
        lines = [{"aux": {"ID": image_id}}]
        if self.quiet:
            lines.append({"stream": f"{image_id}\n"})
        else:
            lines.append({"stream": f"Successfully built {short}\n"})
            lines += [{"stream": f"Successfully tagged {t}\n"} for t in self.tags]
        for doc_line in lines:
            self.send.send_nowait(_line(doc_line))

    async def lines(self) -> AsyncIterator[bytes]:
        self.state.tasks.start_soon(self._run)
        try:
            async with self.receive:
                async for line in self.receive:
                    yield line
        finally:
            self.gone.set()  # a client gone: the worker stops at its next step


ROUTES = [("POST", "build", build)]
