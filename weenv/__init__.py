"""weenv: lazily provisioned, isolated environments for agentic RL and agent evaluation.

The public API is the client of the local daemon::

    import weenv
    with weenv.Client() as client, client.create("plan.lock") as env:
        print(env.exec("echo hello").text)

Names are loaded on first use, so ``import weenv.layerfmt`` stays free of network libraries.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_CLIENT_NAMES = ("ApiError", "AsyncClient", "AsyncEnv", "Client", "DaemonUnavailableError", "Env",
                 "EnvNotFoundError", "ExecResult", "WeenvError")
__all__ = ["__version__", *_CLIENT_NAMES]


def __getattr__(name: str) -> Any:
    if name in ("AsyncClient", "AsyncEnv"):
        from . import _aclient

        return getattr(_aclient, name)
    if name in _CLIENT_NAMES:
        from . import _client

        return getattr(_client, name)
    raise AttributeError(f"module 'weenv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
