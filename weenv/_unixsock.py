"""Unix sockets with an exact file mode, without touching the process-wide umask.

The umask belongs to the whole process: setting it around a ``bind`` from a worker thread (or
around an ``await``, which lets other tasks and threads run) leaks the temporary value into every
file, directory and mount point other threads create meanwhile, and two such threads interleaving
leave the process at the temporary value for good. Instead the socket is bound inside a fresh
0700 directory next to its final path, given its mode there, and renamed into place: nobody can
reach it before it has its mode, and a stale socket at the path is replaced atomically.
"""

from __future__ import annotations

import errno
import os
import socket
import tempfile

_SUN_PATH_MAX = 108  # sizeof(sockaddr_un.sun_path) on Linux, NUL included


def bind_unix(path: str, mode: int = 0o600, *, backlog: int = 128) -> socket.socket:
    """A listening ``SOCK_STREAM`` Unix socket at ``path`` whose file has ``mode`` from the moment
    it appears there. Blocking (file system calls): run it in a worker thread from async code.
    (``getsockname()`` names the private directory it was bound in, which is gone.)"""
    if len(os.fsencode(path)) >= _SUN_PATH_MAX:
        raise OSError(errno.ENAMETOOLONG, f"cannot bind a Unix socket for {path!r}: the path is too long for "
                      f"a socket address ({len(os.fsencode(path))} bytes, at most {_SUN_PATH_MAX - 1})")
    parent = os.path.dirname(path) or "."
    private = tempfile.mkdtemp(prefix=".b", dir=parent)  # 0700: only we can reach what is inside
    inner = os.path.join(private, "s")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.bind(inner)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot bind a Unix socket for {path!r} (at {inner!r}): {exc.strerror}") from None
        os.chmod(inner, mode)
        sock.listen(backlog)
        os.rename(inner, path)
    except BaseException:
        sock.close()
        raise
    finally:
        try:
            os.unlink(inner)
        except FileNotFoundError:
            pass
        os.rmdir(private)
    return sock
