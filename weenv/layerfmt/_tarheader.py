"""Tar headers, byte-identical to ``tarfile``'s PAX format, with a fast path for the common case.

``tarfile.TarInfo.tobuf`` costs ~100 µs per entry in pure Python; most entries (ASCII names up to
100 bytes, no xattrs, small numbers) need only one 512-byte ustar block, which we pack directly.
Everything else goes through ``tarfile`` so long names, non-ASCII names and xattrs use PAX records.
"""

from __future__ import annotations

import tarfile

_TYPE_FLAGS = {
    "file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE, "char": tarfile.CHRTYPE, "block": tarfile.BLKTYPE,
    "fifo": tarfile.FIFOTYPE, "whiteout": tarfile.REGTYPE, "opaque": tarfile.REGTYPE,
}
_LIMIT_8 = 8**7
_LIMIT_12 = 8**11
_MAGIC = tarfile.POSIX_MAGIC  # b"ustar\x0000"
_OWNER_NAMES = bytes(64)  # uname, gname: empty, numeric ids only
_NO_DEVICE = bytes(16)
_TAIL = bytes(155 + 12)  # prefix (unused: long names go to PAX) and block padding
# Checksum of the constant bytes: the checksum field itself counts as 8 spaces, then the magic.
_CONST_SUM = 8 * 32 + sum(_MAGIC)


def tar_header(name: str, kind: str, mode: int, uid: int, gid: int, size: int, mtime: int, link: str = "",
               devmajor: int = 0, devminor: int = 0, xattrs: dict[str, bytes] | None = None) -> bytes:
    """The header block(s) for one entry; ``name`` is the tar name (directories get a trailing slash here)."""
    if kind == "dir" and not name.endswith("/"):
        name += "/"
    if (not xattrs and len(name) <= 100 and len(link) <= 100 and name.isascii() and link.isascii()
            and 0 <= uid < _LIMIT_8 and 0 <= gid < _LIMIT_8 and 0 <= size < _LIMIT_12 and 0 <= mtime < _LIMIT_12
            and devmajor < _LIMIT_8 and devminor < _LIMIT_8):
        # one ustar block; the checksum sums only the bytes that vary instead of all 512
        name_b, link_b, flag = name.encode("ascii"), link.encode("ascii"), _TYPE_FLAGS[kind]
        numbers = b"%07o\x00%07o\x00%07o\x00%011o\x00%011o\x00" % (mode & 0o7777, uid, gid, size, mtime)
        devices = b"%07o\x00%07o\x00" % (devmajor, devminor) if kind in ("char", "block") else _NO_DEVICE
        checksum = _CONST_SUM + sum(name_b) + sum(numbers) + flag[0] + sum(link_b) + sum(devices)
        return b"".join((name_b.ljust(100, b"\x00"), numbers, b"%06o\x00 " % checksum, flag,
                         link_b.ljust(100, b"\x00"), _MAGIC, _OWNER_NAMES, devices, _TAIL))
    ti = tarfile.TarInfo(name)
    ti.type = _TYPE_FLAGS[kind]
    ti.mode, ti.uid, ti.gid, ti.size, ti.mtime = mode, uid, gid, size, mtime
    ti.uname = ti.gname = ""  # numeric ids only: extraction must not remap through the host's passwd
    ti.linkname = link
    ti.devmajor, ti.devminor = devmajor, devminor
    if xattrs:
        ti.pax_headers = {f"SCHILY.xattr.{k}": v.decode("utf-8", "surrogateescape") for k, v in sorted(xattrs.items())}
    return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
