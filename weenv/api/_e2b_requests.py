"""What an E2B create asks for, and the daemon create it becomes: the request bodies the SDK sends
(lenient: fields weenv has no use for are ignored; types are still checked), template names
(an operator's alias, or the caller's own snapshot), and E2B's egress options as weenv's
``[network]`` table."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ._common import ApiState, HttpError, owned_snapshot
from ._store import ApiKey, may_use


class _Body(msgspec.Struct, omit_defaults=True):
    """Requests are lenient (the SDK sends fields weenv has no use for); types are still checked."""


class NetworkConfig(_Body):
    allowOut: list[str] | None = None
    denyOut: list[str] | None = None
    allowPublicTraffic: bool | None = None
    allow_internet_access: bool | None = None
    maskRequestHost: str | None = None


_HOST_MASK = re.compile(r"(?:[A-Za-z0-9-]|\$\{PORT\})+(?:\.(?:[A-Za-z0-9-]|\$\{PORT\})+)*(?::(?:[0-9]+|\$\{PORT\}))?")


def host_mask(network: NetworkConfig | None) -> str | None:
    """``network.maskRequestHost`` checked: a host name (``${PORT}`` anywhere a label may have it),
    optionally ``:port``; the Host header the env's servers see on proxied requests."""
    mask = network.maskRequestHost if network is not None else None
    if mask is None:
        return None
    if len(mask) > 253 or not _HOST_MASK.fullmatch(mask):
        raise HttpError(400, "bad_request", f"request body $.network.maskRequestHost: {mask[:80]!r} is not a host "
                        "name (letters, digits, '-', '.', ${PORT}; e.g. \"${PORT}-myapp.example.com\")")
    return mask


class AutoResume(_Body):
    enabled: bool = False


class VolumeMountBody(_Body):
    name: str
    path: str


class NewSandbox(_Body):
    templateID: str
    timeout: int | None = None
    metadata: dict[str, str] | None = None
    envVars: dict[str, str] | None = None
    autoPause: bool | None = None
    autoPauseMemory: bool | None = None
    """False: the timeout's pause keeps the files only (E2B's ``mode: "filesystem"``)."""
    autoResume: AutoResume | bool | None = None
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    secure: bool | None = None
    volumeMounts: list[VolumeMountBody] | None = None


class TimeoutBody(_Body):
    timeout: int


class RefreshBody(_Body):
    duration: int | None = None


class ConnectBody(_Body):
    timeout: int | None = None
    memory: bool | None = None
    """False: a paused sandbox boots again from its files (E2B's ``on_resume="reboot"``)."""


class PauseBody(_Body):
    memory: bool | None = None
    """False: end the processes, keep the files (E2B's ``mode="filesystem"``)."""
    requireHealthyGuest: bool | None = None


def lifecycle_of(body: NewSandbox) -> dict[str, Any]:
    """The create's lifecycle as the API keeps it: ``on_timeout``, ``pause_memory``, ``auto_resume``;
    a 400 naming the field for what E2B refuses too."""
    auto_resume = body.autoResume.enabled if isinstance(body.autoResume, AutoResume) else bool(body.autoResume)
    if auto_resume and not body.autoPause:
        raise HttpError(400, "bad_request", "request body $.autoResume: auto-resume needs autoPause (a sandbox "
                        "that pauses on its timeout)")
    if auto_resume and body.autoPauseMemory is False:
        raise HttpError(400, "bad_request", "request body $.autoResume: a filesystem-only pause (autoPauseMemory "
                        "false) cannot be woken by traffic: resume it with connect")
    return {"on_timeout": "pause" if body.autoPause else "kill", "pause_memory": body.autoPauseMemory is not False,
            "auto_resume": auto_resume}


class ForkBody(_Body):
    timeout: int | None = None
    count: int | None = None


class SnapshotBody(_Body):
    name: str | None = None


# -- templates ----------------------------------------------------------------------------------


def _resolve_template(state: ApiState, key: ApiKey, template: str) -> dict[str, str]:
    """``{"lock": path}`` or ``{"snapshot": id}``: a snapshot of the key's (by id or name), else an alias."""
    if owned_snapshot(state, key, template) is not None:
        return {"snapshot": template}
    for snap_id, rec in state.owners.snapshots().items():
        if template in (rec.get("names") or []) and may_use(key, rec):
            return {"snapshot": snap_id}
    entry = state.templates.get(template.removesuffix(":default"))
    if entry is not None and entry.get("owner_id") is not None and not may_use(key, entry):
        entry = None  # a template another key built through the SDK (weenv/api/_e2b_templates.py)
    if entry is None:
        from ..registry import is_image_ref
        from ._tenant import check_image

        if is_image_ref(template):  # an image is a template too (docs/images.md); tenants: listed registries
            if not key.admin:
                check_image(state, key, template)
            return {"image": template}
        raise HttpError(404, "template_not_found", f"template '{template}' not found")
    return entry


SDK_DEFAULT_TEMPLATE = "base"
"""What the SDK sends when ``create`` names no template."""


@dataclass(frozen=True)
class ImageRouting:
    """Images named by a create's metadata (``weenv serve --image-metadata-key KEY``): what slime's
    ``E2BSandbox`` sends, ``AsyncSandbox.create(timeout=..., metadata={KEY: image})`` with no
    template. ``size_key`` names a metadata key whose value is one of ``sizes`` (``sm``, ``md``...),
    each the cores and memory its env gets (plan overrides: ``{"cpu": "1", "memory": "1GiB"}``)."""

    metadata_key: str
    size_key: str | None = None
    sizes: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @classmethod
    def parse_size(cls, text: str) -> tuple[str, dict[str, str]]:
        """``NAME=CPU:MEMORY`` (``sm=1:1GiB``; either side may be a range, ``0.5-2:512MiB-2GiB``)."""
        from ..plan._units import parse_cpu_range, parse_memory_range

        name, eq, spec = text.partition("=")
        cpu, colon, memory = spec.partition(":")
        if not eq or not colon or not name.strip() or not cpu or not memory:
            raise ValueError(f"{text!r} is not NAME=CPU:MEMORY (e.g. sm=1:1GiB, lg=4:8GiB)")
        try:
            parse_cpu_range(cpu)
            parse_memory_range(memory)
        except ValueError as e:
            raise ValueError(f"{text!r}: {e}") from None
        return name.strip(), {"cpu": cpu, "memory": memory}

    def route(self, template: str, metadata: Mapping[str, str] | None) -> tuple[str, dict[str, str]] | None:
        """``(image, overrides)`` when ``metadata`` names an image and the template is the SDK's
        default (a named template wins over the metadata), else None."""
        image = (metadata or {}).get(self.metadata_key)
        if not image or template not in ("", SDK_DEFAULT_TEMPLATE):
            return None
        size = (metadata or {}).get(self.size_key) if self.size_key else None
        if size is None:
            return image, {}
        if size not in self.sizes:
            known = ", ".join(sorted(self.sizes)) or "none are configured"
            raise HttpError(400, "bad_request", f"request body $.metadata.{self.size_key}: {size!r} is not a size "
                            f"this server knows ({known})")
        return image, dict(self.sizes[size])


def resolve_create(state: ApiState, key: ApiKey, body: Any) -> tuple[dict[str, str], dict[str, str]]:
    """What a create starts (see :func:`_resolve_template`) and the plan overrides its image's
    size asks for: the image its metadata names (:class:`ImageRouting`), else its template."""
    routing: ImageRouting | None = getattr(state, "image_routing", None)
    routed = routing.route(body.templateID, body.metadata) if routing is not None else None
    if routed is None:
        return _resolve_template(state, key, body.templateID), {}
    from ._tenant import check_image

    image, size = routed
    check_image(state, key, image)
    return {"image": image}, size


ALL_TRAFFIC = "0.0.0.0/0"


def egress_policy(allow_out: list[str] | None, deny_out: list[str] | None,
                  internet: bool | None) -> dict[str, Any] | None:
    """E2B's egress options as weenv's ``[network]`` table; None when none is given.

    E2B opens everything by default, ``denyOut`` closes ranges and ``allowOut`` makes exceptions
    to them (allow wins); ``allow_internet_access=False`` is ``denyOut = [0.0.0.0/0]``. weenv
    closes everything by default and deny wins over allow, so: all traffic denied -> allow only
    ``allowOut``; otherwise allow all (``0.0.0.0/0``: never the implicit denies, docs/network.md)
    and ``allowOut``, deny ``denyOut`` (an ``allowOut`` exception inside a ``denyOut`` range is
    then still denied)."""
    if allow_out is None and deny_out is None and internet is None:
        return None
    allow, deny = list(allow_out or []), list(deny_out or [])
    if internet is False and ALL_TRAFFIC not in deny:
        deny.append(ALL_TRAFFIC)
    if ALL_TRAFFIC in deny:
        return {"mode": "egress", "allow": allow, "deny": [d for d in deny if d != ALL_TRAFFIC]}
    return {"mode": "egress", "allow": [ALL_TRAFFIC, *[a for a in allow if a != ALL_TRAFFIC]], "deny": deny}


def _network_table(body: NewSandbox) -> dict[str, Any] | None:
    net = body.network or NetworkConfig()
    internet = body.allow_internet_access if body.allow_internet_access is not None else net.allow_internet_access
    policy = egress_policy(net.allowOut, net.denyOut, internet)
    if policy is not None and not policy["allow"]:
        return {"mode": "none"}  # nothing may go out: no interface at all
    return policy


def _opens_everything(network: dict[str, Any]) -> bool:
    """Whether egress options ask for nothing beyond E2B's default (all open): they narrow nothing."""
    return network.get("mode") == "egress" and network.get("allow") == [ALL_TRAFFIC] and not network.get("deny")


_network_cache: dict[str, str] = {}


def _plan_network(text: str) -> str:
    """The network mode a lock's text asks for (``none`` when it names none), cached by its text."""
    import hashlib

    key = hashlib.sha256(text.encode()).hexdigest()
    hit = _network_cache.get(key)
    if hit is None:
        try:
            doc = msgspec.json.decode(text) if text.lstrip().startswith("{") else tomllib.loads(text)
        except (ValueError, msgspec.DecodeError):
            return "?"  # the daemon says what is wrong with it
        net = doc.get("network") if isinstance(doc, dict) else None
        hit = net if isinstance(net, str) else (net.get("mode", "none") if isinstance(net, dict) else "none")
        if len(_network_cache) > 256:
            _network_cache.clear()
        _network_cache[key] = hit
    return hit


def _create_request(entry: dict[str, str], body: NewSandbox, timeout_s: int | None,
                    size: dict[str, str] | None = None) -> dict[str, Any]:
    overrides: dict[str, Any] = dict(size or {})
    if timeout_s is not None:
        overrides["ttl_s"] = timeout_s
    if body.envVars:
        overrides["env"] = body.envVars
    network = _network_table(body)
    if "image" in entry:  # the image's plan has network none: a sandbox has lo up, or the one mode asked
        if network is not None and network.get("mode") != "none":
            raise HttpError(400, "bad_request", "egress options on a sandbox of an image: weenv starts it with "
                            "loopback only; register a template lock with a [network] table (weenv template add), "
                            "or change it after create with PUT /sandboxes/{id}/network")
        overrides["network"] = "none" if network is not None else "loopback"
        req: dict[str, Any] = {"image": entry["image"]}
    elif "snapshot" in entry:
        if network is not None and network.get("mode") == "none":
            overrides["network"] = "none"
        elif network is not None and not _opens_everything(network):  # (SDK 2.45 always sends internet access)
            raise HttpError(400, "bad_request", "network options that narrow egress on a sandbox from a snapshot: "
                            "weenv keeps the snapshot's network; change it after create with "
                            "PUT /sandboxes/{id}/network")
        req = {"snapshot": entry["snapshot"]}
    else:
        path = entry["lock"]
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise HttpError(500, "template_unreadable", f"template lock {path}: {e.strerror}") from None
        if network is None:
            req = {"plan_text": text, "format": "json" if text.lstrip().startswith("{") else "toml", "source": path}
            if _plan_network(text) == "none":
                overrides["network"] = "loopback"  # an E2B sandbox has lo up (servers on localhost, get_host)
        else:
            try:
                doc = msgspec.json.decode(text) if text.lstrip().startswith("{") else tomllib.loads(text)
            except (ValueError, msgspec.DecodeError) as e:
                raise HttpError(500, "template_unreadable", f"template lock {path}: {e}") from None
            doc["network"] = network
            req = {"plan": doc}
    if overrides:
        req["overrides"] = overrides
    return req
