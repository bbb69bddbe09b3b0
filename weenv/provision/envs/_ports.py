"""A TCP connection to a port on an env's own loopback, made from the host (``weenv serve``'s port
proxy, E2B's ``get_host``).

The socket is made in a thread that entered the env's network namespace (a socket stays in the
namespace it was made in; the thread is never reused), so the env needs no interface for it.
"""

from __future__ import annotations

import os
import socket

import trio

from .._errors import EnvStateError


async def connect(env_id: str, init_pid: int, port: int) -> socket.socket:
    """A non-blocking socket connected to 127.0.0.1:``port`` in the network namespace of the env's
    init ``init_pid``; EnvStateError when nothing listens there or the init is gone."""
    from ..runtime._ns import CLONE_NEWNET, _check, _libc, in_fresh_thread

    def connect_in_netns() -> socket.socket:
        fd = os.open(f"/proc/{init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _check(_libc.setns(fd, CLONE_NEWNET), "enter the env's network namespace")
        finally:
            os.close(fd)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.settimeout(5.0)
            sock.connect(("127.0.0.1", port))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    try:
        return await trio.to_thread.run_sync(in_fresh_thread, connect_in_netns)  # type: ignore[no-any-return]
    except (ConnectionRefusedError, TimeoutError, socket.timeout):
        raise EnvStateError(f"port {port} is not open (nothing listens on 127.0.0.1:{port} in the env)",
                            env_id=env_id) from None
    except FileNotFoundError:
        raise EnvStateError("its init process is gone", env_id=env_id) from None
