"""Docker's image routes: list, inspect, history, pull (``POST /images/create``).

weenv has no image store of Docker's kind: an image is a registry REF whose layers weenv converts
once (the daemon's image intake, weenv/registry/_convert.py ``lock_for_image``) when an env of it
starts. What this module keeps is, per key, the images that key has used: those its containers
were made from and those it pulled (in the ``weenv serve`` process, as the container records).
A name resolves as container create resolves it: the key's records first (by id, id prefix or a
REF it used), else the REF itself, read from its registry with create's own reader
(:func:`weenv.api._docker_create.read_image`) after the tenant's registry check.

A pull starts an env of the image (through the tenant's checks, admission and quotas, as a create)
and kills it: the daemon converts the layers on that start, so a later create reuses them.
"""

from __future__ import annotations

import fnmatch
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ._common import HttpError, daemon_errors, key_of, log, state_of
from ._docker import not_supported
from ._docker_containers import DockerState, _filters_doc, _flag, _json, docker_state, docker_time
from ._store import ApiKey, may_use

PULL_CPU_CORES = 0.1
"""The cores the pull's short-lived env is admitted with (it runs nothing)."""


@dataclass
class ImageRecord:
    id: str  # the config digest
    owner: dict[str, Any]
    config: dict[str, Any]  # the whole config document (config, rootfs, history, os, ...)
    size_bytes: int  # the layers' compressed bytes, as the manifest gives them
    refs: list[str] = field(default_factory=list)
    used_s: float = field(default_factory=time.time)
    origin: dict[str, Any] = field(default_factory=dict)
    """What an env of it starts from: ``{"image": REF}`` (a registry image), ``{"snapshot": ID}``
    (a commit, weenv/api/_docker_commit.py) or ``{"plan": LOCK}`` (a build, _docker_build.py)."""

    @property
    def local(self) -> bool:
        """Made on this node (a commit or a build), not read from a registry."""
        return "image" not in self.origin


def remember(ds: DockerState, key: ApiKey, ref: str | None, image_id: str, config: dict[str, Any], size: int,
             origin: dict[str, Any] | None = None) -> ImageRecord:
    """``ref`` as an image the key has used (its record made or found; the REF added to its tags,
    taken off any other image of the key's: a tag names one image). ``origin``: what its envs start
    from (default: ``ref`` itself, a registry image); ``ref`` None: an image without a tag."""
    owner = key.owner_fields()
    rec = next((r for r in ds.images if r.id == image_id and r.owner == owner), None)
    if rec is None:
        rec = ImageRecord(image_id, owner, config, size, origin=dict(origin or {"image": ref}))
        ds.images.append(rec)
    if ref is not None and ref not in rec.refs:
        for other in ds.images:  # a tag names one image: the newest it was read as
            if other.owner == owner and ref in other.refs:
                other.refs.remove(ref)
        rec.refs.append(ref)
    rec.used_s = time.time()
    return rec


def images_of(request: Request) -> list[ImageRecord]:
    key = key_of(request)
    return [r for r in docker_state(state_of(request)).images if may_use(key, r.owner)]


def own_images(request: Request) -> list[ImageRecord]:
    """The key's own records: names (tags) resolve among these only, so one key's tag never
    changes what a name means to another key (an admin key included)."""
    owner = key_of(request).owner_fields()
    return [r for r in docker_state(state_of(request)).images if r.owner == owner]


def normalized(name: str) -> str:
    """A name as Docker stores its tag: ``repo`` means ``repo:latest``."""
    last = name.rsplit("/", 1)[-1]
    return name if ":" in last or "@" in last else f"{name}:latest"


def find_tag(request: Request, name: str) -> ImageRecord | None:
    """The key's own image that tag ``name`` names (``repo`` is ``repo:latest``)."""
    for want in dict.fromkeys((name, normalized(name))):
        for r in own_images(request):
            if want in r.refs:
                return r
    return None


def find_id(request: Request, name: str) -> ImageRecord | None:
    """The image an id or unique id prefix (``sha256:`` or not) names, among those the key may use."""
    mine = sorted(images_of(request), key=lambda r: r.owner != key_of(request).owner_fields())
    for r in mine:
        if r.id == name:
            return r
    hex_part = name[len("sha256:"):] if name.startswith("sha256:") else name
    if re.fullmatch(r"[0-9a-f]{1,64}", hex_part):
        hits = {r.id: r for r in reversed(mine) if r.id[len("sha256:"):].startswith(hex_part)}
        if len(hits) == 1:
            return next(iter(hits.values()))
    return None


def _find_recorded(request: Request, name: str) -> ImageRecord | None:
    return find_tag(request, name) or find_id(request, name)


async def resolve(request: Request, name: str) -> ImageRecord:
    """The image ``name`` names for this key: a recorded one, else the REF read from its registry
    (404 ``No such image: NAME`` when that fails; a tenant's REF outside the listed registries is 403)."""
    from ._docker_create import read_image
    from ._tenant import check_image

    rec = _find_recorded(request, name)
    if rec is not None:
        return rec
    state, key = state_of(request), key_of(request)
    from ..registry import is_image_ref

    if re.fullmatch(r"(sha256:)?[0-9a-f]{12,64}", name) or not is_image_ref(name):
        raise HttpError(404, "not_found", f"No such image: {name}")  # not recorded, and no registry REF
    check_image(state, key, name)
    try:
        got = await anyio.to_thread.run_sync(read_image, name)
    except Exception as e:  # not there, not an image, a registry that does not answer
        raise HttpError(404, "not_found", f"No such image: {name} ({type(e).__name__}: {e})"[:500]) from None
    return ImageRecord(got[0], key.owner_fields(), got[1], got[2], [name], origin={"image": name})


def _created(rec: ImageRecord) -> str:
    return str(rec.config.get("created") or "0001-01-01T00:00:00Z")


def _created_epoch(rec: ImageRecord) -> int:
    import datetime as dt

    try:  # RFC 3339, nanoseconds and all: the whole seconds are enough here
        return int(dt.datetime.fromisoformat(_created(rec)[:19] + "+00:00").timestamp())
    except ValueError:
        return 0


def inspect_doc(rec: ImageRecord) -> dict[str, Any]:
    img = dict(rec.config.get("config") or {})
    config = {"Hostname": "", "Domainname": "", "User": img.get("User", ""), "AttachStdin": False,
              "AttachStdout": False, "AttachStderr": False, "ExposedPorts": img.get("ExposedPorts"),
              "Tty": False, "OpenStdin": False, "StdinOnce": False, "Env": img.get("Env"), "Cmd": img.get("Cmd"),
              "Image": "", "Volumes": img.get("Volumes"), "WorkingDir": img.get("WorkingDir", ""),
              "Entrypoint": img.get("Entrypoint"), "OnBuild": img.get("OnBuild"), "Labels": img.get("Labels")}
    if img.get("StopSignal"):
        config["StopSignal"] = img["StopSignal"]
    rootfs = rec.config.get("rootfs") or {}
    return {"Id": rec.id, "RepoTags": list(rec.refs), "RepoDigests": [], "Parent": rec.config.get("parent", ""),
            "Comment": rec.config.get("comment", ""), "Created": _created(rec), "DockerVersion": "",
            "Author": rec.config.get("author", ""), "Config": config,
            "Architecture": rec.config.get("architecture", ""), "Os": rec.config.get("os", ""),
            "Size": rec.size_bytes, "GraphDriver": {"Name": "weenv", "Data": None},
            "RootFS": {"Type": rootfs.get("type", "layers"), "Layers": list(rootfs.get("diff_ids") or [])},
            "Metadata": {"LastTagTime": docker_time(None)}}


async def inspect(request: Request, params: dict[str, str]) -> Response:
    return _json(inspect_doc(await resolve(request, params["name"])))


async def history(request: Request, params: dict[str, str]) -> Response:
    rec = await resolve(request, params["name"])
    out = []
    entries = list(rec.config.get("history") or [])
    for i, h in enumerate(reversed(entries)):
        created = ImageRecord("", {}, {"created": h.get("created")}, 0)
        out.append({"Id": rec.id if i == 0 else "<missing>", "Created": _created_epoch(created),
                    "CreatedBy": h.get("created_by", ""), "Tags": list(rec.refs) if i == 0 else None,
                    "Size": 0, "Comment": h.get("comment", "")})
    return _json(out)


def _passes(rec: ImageRecord, filters: dict[str, list[str]]) -> bool:
    labels = (rec.config.get("config") or {}).get("Labels") or {}
    for want in filters.get("label", []):
        k, eq, v = want.partition("=")
        if k not in labels or (eq and labels[k] != v):
            return False
    for want in filters.get("dangling", []):
        if want.lower() not in ("true", "false", "1", "0"):
            raise HttpError(400, "bad_request", f"invalid filter 'dangling={want[:50]}'")
        if (want.lower() in ("true", "1")) != (not rec.refs):  # dangling: no tag left (untagged, a bare build)
            return False
    refs = filters.get("reference")
    return not refs or any(fnmatch.fnmatchcase(r, pat) or fnmatch.fnmatchcase(r.rsplit(":", 1)[0], pat)
                           for r in rec.refs for pat in refs)


async def list_images(request: Request, params: dict[str, str]) -> Response:
    filters = _filters_doc(request, ("reference", "label", "dangling"))
    out = []
    for rec in sorted(images_of(request), key=lambda r: -r.used_s):
        if not _passes(rec, filters):
            continue
        out.append({"Id": rec.id, "ParentId": "", "RepoTags": list(rec.refs), "RepoDigests": [],
                    "Created": _created_epoch(rec), "Size": rec.size_bytes, "SharedSize": -1,
                    "Labels": (rec.config.get("config") or {}).get("Labels") or {}, "Containers": -1})
    return _json(out)


def _pull_ref(request: Request) -> str:
    if request.query_params.get("fromSrc"):
        raise not_supported("POST /images/create?fromSrc (image import)")
    name, tag = request.query_params.get("fromImage", ""), request.query_params.get("tag", "")
    if not name:
        raise HttpError(400, "bad_request", "fromImage: an image reference is required")
    if tag:
        return f"{name}@{tag}" if tag.startswith("sha256:") else f"{name}:{tag}"
    last = name.rsplit("/", 1)[-1]
    return name if ":" in last or "@" in last else f"{name}:latest"


def _line(doc: dict[str, Any]) -> bytes:
    return msgspec.json.encode(doc) + b"\r\n"


async def _warm(request: Request, ref: str) -> None:
    """An env of ``ref`` started (the daemon converts what its store lacks) and killed at once."""
    from . import _tenant

    state, key = state_of(request), key_of(request)
    req, _public, plan = _tenant.create_body(state, key, msgspec.json.encode(
        {"image": ref, "overrides": {"cpu": PULL_CPU_CORES, "network": "none"}}))
    admission = await _tenant.admit_create(state, key, req, plan)
    try:
        async with daemon_errors():
            info = msgspec.to_builtins(await state.backend.create(req))
    finally:
        admission.release()
    try:
        async with daemon_errors():
            await state.backend.kill(info["id"])
    except HttpError as e:
        log.warning("docker: pull of %s: killing its env %s: %s", ref, info["id"], e.message)
    state.envs_gone([info["id"]])


async def pull(request: Request, params: dict[str, str]) -> Response:
    ref = _pull_ref(request)
    rec = await resolve(request, ref)  # 403/404 before the stream starts, as dockerd's manifest errors
    ds, key = docker_state(state_of(request)), key_of(request)
    had = _find_recorded(request, ref) is not None
    tag = ref.rsplit("@", 1)[1] if "@" in ref else ref.rsplit(":", 1)[1]

    async def body() -> AsyncIterator[bytes]:
        yield _line({"status": f"Pulling from {ref.rsplit('@', 1)[0].rsplit(':', 1)[0]}", "id": tag})
        try:
            await _warm(request, ref)
        except HttpError as e:
            yield _line({"errorDetail": {"message": e.message}, "error": e.message})
            return
        remember(ds, key, ref, rec.id, rec.config, rec.size_bytes)
        yield _line({"status": f"Digest: {rec.id}"})
        yield _line({"status": f"Status: {'Image is up to date' if had else 'Downloaded newer image'} for {ref}"})

    return StreamingResponse(body(), 200, media_type="application/json")


# -- tag and remove ---------------------------------------------------------------------------------

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?)"
_PATH = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_HOST_ONLY = re.compile(rf"^{_HOST}$")


def _valid_repo(repo: str) -> bool:
    """Docker's rule (distribution/reference ``ParseNormalizedNamed``): the first component is a
    registry host when it holds a '.' or a ':' or is ``localhost``; the path is lowercase."""
    first, sep, rest = repo.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return bool(_HOST_ONLY.match(first)) and bool(_PATH.match(rest))
    return bool(_PATH.match(repo))
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")


def tag_ref(repo: str, tag: str, where: str = "repo") -> str:
    """``repo:tag`` after Docker's reference grammar (distribution/reference): 400 naming what is
    wrong, as dockerd's ``invalid reference format`` / ``invalid tag format``."""
    if not repo:
        raise HttpError(400, "bad_request", f"{where}: a repository name is required")
    last = repo.rsplit("/", 1)[-1]
    if ":" in last and not tag:  # ``repo:tag`` in one (``t=`` of a build)
        repo, tag = repo.rsplit(":", 1)
    if "@" in repo:
        raise HttpError(400, "bad_request", f"{where} {repo[:200]!r}: refusing to create a tag with a digest "
                        "reference")
    if not _valid_repo(repo) or len(repo) > 255:
        lower = ": repository name must be lowercase" if _valid_repo(repo.lower()) else ""
        raise HttpError(400, "bad_request", f"invalid reference format{lower} ({where} {repo[:200]!r})")
    tag = tag or "latest"
    if not _TAG.match(tag):
        raise HttpError(400, "bad_request", f"invalid tag format ({tag[:200]!r}: letters, digits, '_', '.', '-'; "
                        "at most 128, not starting with '.' or '-')")
    return f"{repo}:{tag}"


async def tag(request: Request, params: dict[str, str]) -> Response:
    """``image.tag(repo, tag)``: one more name for an image, the key's own (docs/docker.md)."""
    new = tag_ref(request.query_params.get("repo", ""), request.query_params.get("tag", ""))
    rec = await resolve(request, params["name"])
    remember(docker_state(state_of(request)), key_of(request), new, rec.id, rec.config, rec.size_bytes,
             origin=rec.origin)
    return Response(b"", 201)


def _short(image_id: str) -> str:
    return image_id.removeprefix("sha256:")[:12]


def _delete_conflict(rec: ImageRecord, users: list[Any], force: bool) -> str | None:
    """dockerd's ``checkImageDeleteConflict``: a running container is a hard conflict, a stopped
    one a soft one (``force`` overrides soft ones only)."""
    running = next((c for c in users if c.running), None)
    if running is not None:
        return (f"conflict: unable to delete {_short(rec.id)} (cannot be forced) - image is being used by running "
                f"container {running.id[:12]}")
    stopped = next((c for c in users if not c.running), None)
    if stopped is not None and not force:
        return (f"conflict: unable to delete {_short(rec.id)} (must be forced) - image is being used by stopped "
                f"container {stopped.id[:12]}")
    return None


async def _forget(request: Request, rec: ImageRecord) -> None:
    """The record gone; a commit's snapshot deleted on its daemon when no record names it any more
    (a registry image's converted layers stay in the store: they are a cache every image shares)."""
    state = state_of(request)
    ds = docker_state(state)
    ds.images.remove(rec)
    snap = rec.origin.get("snapshot")
    if not isinstance(snap, str) or any(r.origin.get("snapshot") == snap for r in ds.images):
        return
    try:
        async with daemon_errors():
            await (await state.backend.for_snapshot(snap)).delete_snapshot(snap)
        state.owners.forget_snapshot(snap)
    except HttpError as e:  # an env of it still runs (a removed container's image): its daemon keeps it
        log.warning("docker: image %s: deleting its snapshot %s: %s", rec.id[:19], snap, e.message)


async def remove_image(request: Request, params: dict[str, str]) -> Response:
    """``images.remove(name, force=, noprune=)``, dockerd's ``ImageDelete``: a tag is untagged, and
    the image deleted when no tag is left and no container of the key's uses it (409 otherwise,
    unless ``force``; a running container's image is never deleted, only untagged)."""
    name = params["name"]
    force = _flag(request, "force")
    _flag(request, "noprune")  # checked; an image here has no parents to keep or prune
    ds = docker_state(state_of(request))
    by_tag = find_tag(request, name)
    rec = by_tag or find_id(request, name)
    if rec is None:
        raise HttpError(404, "not_found", f"No such image: {name}")
    users = [c for c in ds.containers.values() if c.owner == rec.owner and c.image_id == rec.id]
    out: list[dict[str, str]] = []
    quiet = False
    if by_tag is not None:
        ref = name if name in rec.refs else normalized(name)
        if users and len(rec.refs) == 1 and not force:
            raise HttpError(409, "conflict", f'conflict: unable to remove repository reference "{name}" (must force) '
                            f"- container {users[0].id[:12]} is using its referenced image {_short(rec.id)}")
        rec.refs.remove(ref)
        out.append({"Untagged": ref})
        if rec.refs:
            return _json(out)
        quiet = True  # dockerd: a conflict now leaves the image untagged, not an error
    elif len(rec.refs) > 1 and not force:
        raise HttpError(409, "conflict", f"conflict: unable to delete {_short(rec.id)} (must be forced) - image is "
                        "referenced in multiple repositories")
    else:
        problem = _delete_conflict(rec, users, force)
        if problem is not None:
            raise HttpError(409, "conflict", problem)
        out += [{"Untagged": r} for r in rec.refs]
        rec.refs.clear()
    problem = _delete_conflict(rec, users, force)
    if problem is not None:
        if quiet:
            return _json(out)
        raise HttpError(409, "conflict", problem)
    await _forget(request, rec)
    out.append({"Deleted": rec.id})
    return _json(out)


ROUTES = [
    ("GET", "images/json", list_images),
    ("POST", "images/{name*}/tag", tag),
    ("DELETE", "images/{name*}", remove_image),
    ("POST", "images/create", pull),
    ("GET", "images/{name*}/json", inspect),
    ("GET", "images/{name*}/history", history),
]
