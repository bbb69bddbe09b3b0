"""Registry authentication without I/O: challenge parsing, credentials lookup, token bookkeeping.

The remote store drives :class:`Authenticator`: it asks for a header before a request, and after a
401 it hands over the ``WWW-Authenticate`` value and gets back a :class:`AuthStep` (send this
header / fetch a token with this request / give up with this message). Nothing here opens a socket,
so every decision is unit-tested with a fake clock.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ._errors import AuthError

# --------------------------------------------------------------------------------------- challenges


@dataclass(frozen=True)
class Challenge:
    scheme: str  # lower-case: "basic" or "bearer"
    params: dict[str, str] = field(default_factory=dict)


_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_PARAM = re.compile(rf'\s*({_TOKEN})\s*=\s*("(?:[^"\\]|\\.)*"|{_TOKEN}=*)\s*')
_SCHEME = re.compile(rf"\s*({_TOKEN})(?=\s|$|,)")


def parse_www_authenticate(header: str) -> list[Challenge]:
    """Parse a ``WWW-Authenticate`` value into challenges (RFC 7235: several, comma-separated)."""
    out: list[Challenge] = []
    pos, n = 0, len(header)
    current: Challenge | None = None
    while pos < n:
        if header[pos] in ", \t":
            pos += 1
            continue
        m = _PARAM.match(header, pos)
        if m and current is not None:
            value = m.group(2)
            if value.startswith('"'):
                value = re.sub(r"\\(.)", r"\1", value[1:-1])
            current.params[m.group(1).lower()] = value
            pos = m.end()
            continue
        s = _SCHEME.match(header, pos)
        if not s:
            break  # garbage: keep what was understood
        current = Challenge(s.group(1).lower(), {})
        out.append(current)
        pos = s.end()
    return out


# --------------------------------------------------------------------------------------- credentials


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str

    def basic_header(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode("ascii")

    def __repr__(self) -> str:  # never print the secret
        return f"Credentials(username={self.username!r}, password=<{len(self.password)} chars>)"


def _config_keys(registry: str) -> list[str]:
    keys = [registry, f"https://{registry}", f"http://{registry}", f"https://{registry}/v2/", f"http://{registry}/v2/"]
    if registry in ("docker.io", "registry-1.docker.io", "index.docker.io"):
        keys.append("https://index.docker.io/v1/")
    return keys


def credentials_from_docker_config(config: Mapping[str, object], registry: str, *, where: str = "config") -> Credentials | None:
    """Credentials for ``registry`` from a parsed docker ``config.json`` (``auths.<host>.auth``, base64)."""
    auths = config.get("auths")
    if not isinstance(auths, Mapping):
        return None
    for key in _config_keys(registry):
        entry = auths.get(key)
        if not isinstance(entry, Mapping):
            continue
        if isinstance(entry.get("auth"), str) and entry["auth"]:
            try:
                user, sep, password = base64.b64decode(entry["auth"], validate=True).decode("utf-8").partition(":")
            except (binascii.Error, UnicodeDecodeError):
                raise AuthError(f"{where}: auths[{key!r}].auth is not base64 of user:password") from None
            if not sep:
                raise AuthError(f"{where}: auths[{key!r}].auth does not decode to user:password")
            return Credentials(user, password)
        if isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
            return Credentials(entry["username"], entry["password"])
    return None


def docker_config_paths(env: Mapping[str, str]) -> list[str]:
    paths = []
    if env.get("DOCKER_CONFIG"):
        paths.append(os.path.join(env["DOCKER_CONFIG"], "config.json"))
    home = env.get("HOME") or os.path.expanduser("~")
    paths.append(os.path.join(home, ".docker", "config.json"))
    return paths


def load_credentials(registry: str, env: Mapping[str, str] | None = None) -> Credentials | None:
    """Credentials from WEENV_REGISTRY_USERNAME/PASSWORD, else the first docker config.json naming the host."""
    env = os.environ if env is None else env
    user, password = env.get("WEENV_REGISTRY_USERNAME"), env.get("WEENV_REGISTRY_PASSWORD")
    if user and password is not None:
        return Credentials(user, password)
    for path in docker_config_paths(env):
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise AuthError(f"cannot read docker config {path}: {e}") from None
        if isinstance(config, Mapping):
            creds = credentials_from_docker_config(config, registry, where=path)
            if creds is not None:
                return creds
    return None


# --------------------------------------------------------------------------------------- decisions


def scope_for(repo: str, push: bool = False, delete: bool = False) -> str:
    return f"repository:{repo}:{'delete' if delete else 'pull,push' if push else 'pull'}"


@dataclass(frozen=True)
class UseHeader:
    """Retry the request with this ``Authorization`` value."""

    authorization: str


@dataclass(frozen=True)
class FetchToken:
    """GET ``realm`` with ``params`` (and ``authorization`` if set), then call :meth:`Authenticator.token_received`."""

    realm: str
    params: dict[str, str]
    authorization: str | None
    scope: str


@dataclass(frozen=True)
class Denied:
    message: str


AuthStep = UseHeader | FetchToken | Denied

_DEFAULT_TOKEN_TTL_S = 60.0
_EXPIRY_MARGIN_S = 5.0


class Authenticator:
    """What ``Authorization`` header to send to one registry, learnt from its challenges.

    Basic auth, once asked for, is sent up front on every later request; Bearer tokens are cached
    per scope until shortly before they expire.
    """

    def __init__(self, registry: str, credentials: Credentials | None, clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        self.credentials = credentials
        self._clock = clock
        self._basic = False
        self._tokens: dict[str, tuple[str, float]] = {}  # scope -> (header, expires_at)

    def header(self, scope: str) -> str | None:
        if self._basic and self.credentials is not None:
            return self.credentials.basic_header()
        cached = self._tokens.get(scope)
        if cached is None and scope.endswith(":pull"):
            cached = self._tokens.get(scope + ",push")  # a push token also reads
        if cached is not None and cached[1] > self._clock():
            return cached[0]
        return None

    def respond(self, www_authenticate: str | None, scope: str, *, retried: bool) -> AuthStep:
        """Decide what to do after a 401 carrying ``www_authenticate``.

        ``retried``: this request already answered a challenge, so the credentials (or the fresh
        token) were refused; asking again would loop.
        """
        who = self.registry
        challenges = parse_www_authenticate(www_authenticate or "")
        if not challenges:
            return Denied(f"{who}: 401 without a usable WWW-Authenticate challenge")
        by_scheme = {c.scheme: c for c in challenges}
        if "bearer" in by_scheme:
            c = by_scheme["bearer"]
            self._tokens.pop(scope, None)
            if retried:
                return Denied(self._refused_message(scope))
            realm = c.params.get("realm")
            if not realm:
                return Denied(f"{who}: Bearer challenge without a realm")
            params = {"service": c.params["service"]} if c.params.get("service") else {}
            params["scope"] = c.params.get("scope") or scope
            auth = self.credentials.basic_header() if self.credentials else None
            return FetchToken(realm, params, auth, scope)
        if "basic" in by_scheme:
            if self.credentials is None:
                return Denied(
                    f"{who}: the registry asks for a username and password; set WEENV_REGISTRY_USERNAME/"
                    f"WEENV_REGISTRY_PASSWORD or add auths[{who!r}] to $DOCKER_CONFIG/config.json"
                )
            if retried:
                return Denied(f"{who}: username {self.credentials.username!r} was refused (401 on basic auth)")
            self._basic = True
            return UseHeader(self.credentials.basic_header())
        return Denied(f"{who}: unsupported auth scheme(s) {sorted(by_scheme)}")

    def _refused_message(self, scope: str) -> str:
        who = self.registry
        if self.credentials is None:
            return f"{who}: anonymous access refused for {scope}; credentials needed (WEENV_REGISTRY_USERNAME or docker config)"
        return f"{who}: token for {self.credentials.username!r} refused for {scope}"

    def token_received(self, scope: str, status: int, body: bytes) -> AuthStep:
        """Digest the token endpoint's answer into the header to use (or a refusal)."""
        if status in (401, 403):
            return Denied(
                f"{self.registry}: token endpoint refused "
                + (f"user {self.credentials.username!r}" if self.credentials else "anonymous access")
                + f" for {scope} (HTTP {status})"
            )
        if status != 200:
            return Denied(f"{self.registry}: token endpoint answered HTTP {status} for {scope}")
        try:
            data = json.loads(body)
            token = data.get("token") or data.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            return Denied(f"{self.registry}: token endpoint answered without a token for {scope}")
        ttl = data.get("expires_in")
        ttl_s = float(ttl) if isinstance(ttl, (int, float)) and ttl > 0 else _DEFAULT_TOKEN_TTL_S
        header = f"Bearer {token}"
        self._tokens[scope] = (header, self._clock() + max(ttl_s - _EXPIRY_MARGIN_S, 1.0))
        return UseHeader(header)
