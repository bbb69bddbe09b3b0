"""The two byte seams of the format: a random-access reader in, a sequential writer out."""

from __future__ import annotations

import os
from typing import BinaryIO, Protocol, runtime_checkable

from ._errors import TruncatedLayerError


@runtime_checkable
class RandomAccessReader(Protocol):
    """Where a layer's bytes come from: a file, a registry blob, a cache."""

    @property
    def size(self) -> int:
        """Total size of the blob in bytes."""
        ...

    def read_at(self, offset: int, n: int) -> bytes:
        """Return exactly ``n`` bytes starting at ``offset`` (fewer only past the end)."""
        ...


class BytesReader:
    """A reader over bytes held in memory."""

    def __init__(self, data: bytes | bytearray | memoryview):
        self._data = bytes(data)

    @property
    def size(self) -> int:
        return len(self._data)

    def read_at(self, offset: int, n: int) -> bytes:
        return self._data[offset : offset + n]


class FileReader:
    """A reader over an open file descriptor (positional reads, safe to share between threads)."""

    def __init__(self, fd: int, size: int | None = None):
        self._fd = fd
        self._size = os.fstat(fd).st_size if size is None else size

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "FileReader":
        return cls(os.open(path, os.O_RDONLY | os.O_CLOEXEC))

    @property
    def size(self) -> int:
        return self._size

    def read_at(self, offset: int, n: int) -> bytes:
        parts = []
        while n > 0:
            b = os.pread(self._fd, n, offset)
            if not b:
                break
            parts.append(b)
            offset += len(b)
            n -= len(b)
        return b"".join(parts) if len(parts) != 1 else parts[0]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "FileReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_exact(reader: RandomAccessReader, offset: int, n: int, what: str) -> bytes:
    """Read ``n`` bytes or raise :class:`TruncatedLayerError` naming ``what``."""
    if offset < 0 or n < 0 or offset + n > reader.size:
        raise TruncatedLayerError(
            f"{what} lies outside the blob (needs bytes {offset}..{offset + n}, blob has {reader.size})",
            offset=offset,
        )
    data = reader.read_at(offset, n)
    if len(data) != n:
        raise TruncatedLayerError(f"short read of {what}: wanted {n} bytes, got {len(data)}", offset=offset)
    return data


Writer = BinaryIO
"""Anything with ``write(bytes)``; the builder never seeks."""
