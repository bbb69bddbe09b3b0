"""Tar headers, byte-identical to ``tarfile``'s PAX format, with a fast path for the common case.

``tarfile.TarInfo.tobuf`` costs ~100 µs per entry in pure Python; most entries (ASCII names up to
100 bytes, no xattrs, small numbers) need only one 512-byte ustar block, which we pack directly.
Everything else goes through ``tarfile`` so long names, non-ASCII names and xattrs use PAX records.
"""

from __future__ import annotations

import struct
import tarfile

_TYPE_FLAGS = {
    "file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE, "char": tarfile.CHRTYPE, "block": tarfile.BLKTYPE,
    "fifo": tarfile.FIFOTYPE, "whiteout": tarfile.REGTYPE, "opaque": tarfile.REGTYPE,
}
_USTAR = struct.Struct("100s8s8s8s12s12s8s1s100s8s32s32s8s8s155s12x")
_LIMIT_8 = 8**7
_LIMIT_12 = 8**11
_SPACES = b"        "
_MAGIC = tarfile.POSIX_MAGIC  # b"ustar\x0000"


def _o8(n: int) -> bytes:
    return b"%07o\x00" % n


def _o12(n: int) -> bytes:
    return b"%011o\x00" % n


def tar_header(name: str, kind: str, mode: int, uid: int, gid: int, size: int, mtime: int, link: str = "",
               devmajor: int = 0, devminor: int = 0, xattrs: dict[str, bytes] | None = None) -> bytes:
    """The header block(s) for one entry; ``name`` is the tar name (directories get a trailing slash here)."""
    if kind == "dir" and not name.endswith("/"):
        name += "/"
    if (not xattrs and len(name) <= 100 and len(link) <= 100 and name.isascii() and link.isascii()
            and 0 <= uid < _LIMIT_8 and 0 <= gid < _LIMIT_8 and 0 <= size < _LIMIT_12 and 0 <= mtime < _LIMIT_12):
        block = bytearray(_USTAR.pack(
            name.encode("ascii"), _o8(mode & 0o7777), _o8(uid), _o8(gid), _o12(size), _o12(mtime), _SPACES,
            _TYPE_FLAGS[kind], link.encode("ascii"), _MAGIC, b"", b"",
            *((_o8(devmajor), _o8(devminor)) if kind in ("char", "block") else (b"", b"")), b"",
        ))
        if devmajor < _LIMIT_8 and devminor < _LIMIT_8:
            block[148:156] = b"%06o\x00 " % sum(block)
            return bytes(block)
    ti = tarfile.TarInfo(name)
    ti.type = _TYPE_FLAGS[kind]
    ti.mode, ti.uid, ti.gid, ti.size, ti.mtime = mode, uid, gid, size, mtime
    ti.uname = ti.gname = ""  # numeric ids only: extraction must not remap through the host's passwd
    ti.linkname = link
    ti.devmajor, ti.devminor = devmajor, devminor
    if xattrs:
        ti.pax_headers = {f"SCHILY.xattr.{k}": v.decode("utf-8", "surrogateescape") for k, v in sorted(xattrs.items())}
    return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
