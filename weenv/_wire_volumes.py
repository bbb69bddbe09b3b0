"""The daemon's volume API bodies (``/v1/volumes...``), beside :mod:`weenv._wire` and under its rules:
requests strict, answers lenient, every query parameter a bounded string."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from ._wire import OctalMode, Path, RequestBody, ResponseBody

__all__ = ["VolumeCreateRequest", "VolumeFilesQuery", "VolumeInfo", "VolumeRemoveQuery", "VolumeRemoved",
           "VolumeWriteQuery"]

VolumeName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]
Id = Annotated[str, Meta(pattern=r"^[0-9]{1,10}$")]
"""A uid or gid inside the env, as a query parameter."""


class VolumeCreateRequest(RequestBody):
    """``POST /v1/volumes``: a new volume of ``size_bytes`` (default 1 GiB), named ``name`` (default its id)."""

    name: VolumeName | None = None
    size_bytes: Annotated[int, Meta(ge=16 << 20, le=64 << 40)] | None = None


class VolumeInfo(ResponseBody, kw_only=True):
    """One volume: ``envs`` mount it now; ``used_bytes`` while it is mounted on the host (else None)."""

    id: str
    name: str
    size_bytes: int
    created_s: float = 0.0
    envs: list[str] = []
    mounted: bool = False
    used_bytes: int | None = None


class VolumeRemoved(ResponseBody):
    id: str
    name: str = ""


class VolumeFilesQuery(RequestBody):
    """``GET /v1/volumes/{id}/files?path=&op=read|list|stat``."""

    path: Path
    op: Literal["read", "list", "stat"] = "read"


class VolumeWriteQuery(RequestBody):
    """``PUT .../files``, ``POST .../files/mkdir`` and ``POST .../files/chattr`` of a volume: the
    mode and owner (env ids) of what is written, made or changed."""

    path: Path
    mode: OctalMode | None = None
    uid: Id | None = None
    gid: Id | None = None

    def ids(self) -> tuple[int | None, int | None]:
        return (None if self.uid is None else int(self.uid), None if self.gid is None else int(self.gid))


class VolumeRemoveQuery(RequestBody):
    """``DELETE /v1/volumes/{id}/files?path=&recursive=``."""

    path: Path
    recursive: Literal["0", "1"] = "0"
