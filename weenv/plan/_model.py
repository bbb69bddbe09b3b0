"""The plan and lock schema: strict msgspec Structs, their value rules and their defaults.

Every Struct derives from :class:`_Strict` (unknown fields rejected, frozen, keyword-only). Field
names are the TOML/JSON keys, except ``Group.group_class`` which is spelled ``class`` in files.
Value rules that concern one field live in the ``Annotated[..., Meta(...)]`` types below, so they
reach the JSON Schema too; rules that relate several fields live in :mod:`._validate`.

All defaults are the ``DEFAULT_*`` constants of this module, documented in docs/plan.md.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ..net._policy import BANDWIDTH_PATTERN
from ._ref import _DOMAIN, _REPO, DIGEST_PATTERN, REF_PATTERN

MiB = 1024**2
GiB = 1024**3

DEFAULT_CPU_MIN_CORES = 0.25
DEFAULT_CPU_MAX_CORES = 2.0
DEFAULT_MEMORY_MIN_BYTES = 256 * MiB
DEFAULT_MEMORY_MAX_BYTES = 2 * GiB
DEFAULT_PIDS = 1024
DEFAULT_DISK_BYTES = 1 * GiB
# under gVisor an env's file writes stay in the sandbox's memory: its disk must leave the Sentry this
# much of its memory max (measured: 224 MiB of files in 256 MiB ran on; 240 MiB killed the sandbox)
GVISOR_MEMORY_HEADROOM_BYTES = 32 * MiB
DEFAULT_NETWORK = "none"
# Below a few MiB crun and the init cannot start; a limit that small is nearly always a unit slip
# (``max = 2048`` meaning MiB), so it is rejected rather than obeyed.
MIN_MEMORY_BYTES = 4 * MiB
MIN_DISK_BYTES = 1 * MiB
MAX_CORES = 1024.0
MAX_PIDS = 4_194_304  # the kernel's own ceiling for pid_max
# Upper bounds: what a plan may ask of any node. A value above them is a slip (10**20 bytes of
# memory, 1e308 s), not a wish; admission then refuses what this particular node cannot hold.
TiB = 1024**4
MAX_MEMORY_BYTES = 1 * TiB
MAX_DISK_BYTES = 64 * TiB
MAX_LAYER_BYTES = 16 * TiB
MAX_TTL_S = 30 * 86400.0
# The kernel refuses an exec whose one "NAME=value" or argument string (with its NUL) exceeds
# MAX_ARG_STRLEN (32 pages = 128 KiB), or whose argv + envp exceed ARG_MAX (2 MiB with the
# default 8 MiB stack): bounded below that, so the init and exec always start.
MAX_ARG_STRLEN = 128 * 1024
MAX_ENV_BYTES = 1 * MiB
MAX_ENV_VARS = 4096
MAX_INIT_BYTES = 512 * 1024
MAX_INIT_ARGS = 4096
MAX_GROUPS = 128  # overlayfs stacks at most 500 lowers; snapshots add theirs on top
MAX_MOUNTS = 64
MAX_VOLUMES = 32
VOLUME_REF_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
LOCK_VERSION = 1

GROUP_CLASSES: tuple[str, ...] = ("os", "toolchain", "harness", "evaluator", "task")
"""Change-rate classes, bottom first: groups are listed in this order (equal classes may repeat)."""
NETWORKS: tuple[str, ...] = ("none", "loopback", "egress", "host")

NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
NO_NUL_PATTERN = r"^[^\x00]*$"
ABS_PATH_PATTERN = r"^/[^\x00]*$"
USER_PATTERN = r"^([A-Za-z_][A-Za-z0-9_.-]*[$]?|[0-9]+)(:([A-Za-z_][A-Za-z0-9_.-]*|[0-9]+))?$"
SNAPSHOT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
REGISTRY_PATTERN = rf"^{_DOMAIN}$"
REPO_PATTERN = rf"^{_REPO}$"

PATTERN_DESCRIPTIONS: dict[str, str] = {
    NAME_PATTERN: "a lowercase name of letters, digits and '-' (1-63 characters, starting and "
    "ending with a letter or digit)",
    REF_PATTERN: "a reference like host/repo:tag",
    DIGEST_PATTERN: "a digest like sha256:<64 lowercase hex digits>",
    ENV_NAME_PATTERN: "an environment variable name (letters, digits and '_', not starting with a digit)",
    NO_NUL_PATTERN: "a string without NUL characters",
    ABS_PATH_PATTERN: "an absolute path",
    USER_PATTERN: "a user name or uid, optionally followed by :group or :gid",
    SNAPSHOT_PATTERN: "a snapshot id (letters, digits and . _ : -)",
    REGISTRY_PATTERN: "a registry host such as registry.example.com:5000",
    REPO_PATTERN: "a repository path such as team/harness",
    BANDWIDTH_PATTERN: "a rate such as '100Mbit', '1.5Gbit' or '800kbit'",
}
"""Words for each pattern, used in error messages instead of the regular expression."""

# ``extra={"unit": "bytes"}`` marks size fields: they also accept strings such as "2GiB" (see
# _codec.normalize_sizes), their JSON Schema admits both forms, and TOML output writes them as text.
SIZE_UNIT = {"unit": "bytes"}

Name = Annotated[str, Meta(pattern=NAME_PATTERN, description="Lowercase DNS-label-like name.")]
Ref = Annotated[str, Meta(pattern=REF_PATTERN, max_length=512,
                          description="Group reference: [host[:port]/]repo:tag, repo@sha256:…, or both.")]
Digest = Annotated[str, Meta(pattern=DIGEST_PATTERN, description="sha256:<64 hex digits>.")]
EnvName = Annotated[str, Meta(pattern=ENV_NAME_PATTERN, max_length=1024)]
EnvValue = Annotated[str, Meta(pattern=NO_NUL_PATTERN, max_length=MAX_ARG_STRLEN)]
AbsPath = Annotated[str, Meta(pattern=ABS_PATH_PATTERN, max_length=4096, description="Absolute path.")]
Arg = Annotated[str, Meta(pattern=NO_NUL_PATTERN, max_length=MAX_ARG_STRLEN)]
User = Annotated[str, Meta(pattern=USER_PATTERN, max_length=256,
                           description="User name or uid, optionally :group or :gid.")]
Cores = Annotated[float, Meta(gt=0, le=MAX_CORES, description="CPU cores (fractions allowed).")]
MemorySize = Annotated[int, Meta(ge=MIN_MEMORY_BYTES, le=MAX_MEMORY_BYTES, extra=SIZE_UNIT,
                                 description='Bytes, or a size such as "512MiB", "2GiB", "1.5G".')]
DiskSize = Annotated[int, Meta(ge=MIN_DISK_BYTES, le=MAX_DISK_BYTES, extra=SIZE_UNIT,
                               description='Bytes, or a size such as "512MiB", "2GiB", "1.5G".')]
GroupClass = Literal["os", "toolchain", "harness", "evaluator", "task"]
Network = Literal["none", "loopback", "egress", "host"]
RuntimeName = Literal["crun", "gvisor"]
NetworkEntry = Annotated[str, Meta(min_length=1, max_length=300, description=(
    '"CIDR[:ports]", "host.name[:ports]" or "node[:ports]"; ports: N or N-M (tcp and udp).'))]
MAX_NETWORK_ENTRIES = 1024


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base of every plan Struct: unknown keys are errors, values are immutable."""


class Group(_Strict, kw_only=True):
    """One layer group of the environment's root filesystem."""

    name: Annotated[Name, Meta(description="Group name, unique within the plan.")]
    ref: Ref
    group_class: Annotated[GroupClass, Meta(
        description="Change-rate class; groups are listed os, toolchain, harness, evaluator, task."
    )] = msgspec.field(name="class")


class LockedGroup(Group, kw_only=True):
    """A group pinned by ``weenv plan lock``: starting from it never resolves a tag."""

    digest: Annotated[Digest, Meta(description="Manifest digest of the group artifact.")]
    layer_digest: Annotated[Digest, Meta(description="Digest of the group's layer blob.")]
    layer_size: Annotated[int, Meta(ge=0, le=MAX_LAYER_BYTES, description="Size of the layer blob in bytes.")]
    toc_digest: Annotated[Digest, Meta(description="Digest of the layer's table of contents.")]
    registry: Annotated[str, Meta(pattern=REGISTRY_PATTERN, description=(
        "Registry host the group was resolved on; absent for the embedded local store."
    ))] | None = None
    repo: Annotated[str, Meta(pattern=REPO_PATTERN, description="Repository holding the group.")]

    @property
    def pinned_ref(self) -> str:
        """``[registry/]repo@digest``: the ref to fetch, which no tag move can change."""
        base = f"{self.registry}/{self.repo}" if self.registry else self.repo
        return f"{base}@{self.digest}"


class CpuRange(_Strict, kw_only=True):
    """CPU cores the elastic monitor may grant: it starts at ``min`` and grows up to ``max``."""

    min: Cores = DEFAULT_CPU_MIN_CORES
    max: Cores = DEFAULT_CPU_MAX_CORES


class MemoryRange(_Strict, kw_only=True):
    """Memory the elastic monitor may grant, in bytes: guaranteed ``min``, hard limit ``max``."""

    min: MemorySize = DEFAULT_MEMORY_MIN_BYTES
    max: MemorySize = DEFAULT_MEMORY_MAX_BYTES


class Resources(_Strict, kw_only=True):
    """Limits of the environment."""

    cpu: CpuRange = CpuRange()
    memory: MemoryRange = MemoryRange()
    pids: Annotated[int, Meta(ge=1, le=MAX_PIDS, description="Most processes and threads at once.")] = DEFAULT_PIDS
    disk: Annotated[DiskSize, Meta(description="Bound of the writable upper directory.")] = DEFAULT_DISK_BYTES


class Mount(_Strict, kw_only=True):
    """A read-only bind mount of a host path into the environment (explicit opt-in)."""

    source: Annotated[AbsPath, Meta(description=(
        "Host path (absolute, normalised); not one that exposes the host (/, /proc, /sys, /dev, /etc, "
        "/boot, /root, /run, /var/run, container runtime state, $WEENV_HOME) nor one above or inside them."))]
    target: Annotated[AbsPath, Meta(description="Path inside the environment; not /, /proc, /sys or /dev.")]


class VolumeMount(_Strict, kw_only=True):
    """A ``[[volumes]]`` table: a volume of the node (``weenv volume create``) mounted into the env."""

    name: Annotated[str, Meta(pattern=VOLUME_REF_PATTERN, description=(
        "The volume's name or id on the node (letters, digits, '_', '.', '-'; at most 63)."))]
    path: Annotated[AbsPath, Meta(description="Where it appears in the env (absolute); not /, /proc, /sys or /dev.")]
    read_only: Annotated[bool, Meta(description="Mount it read-only: writes fail with EROFS.")] = False


class NetworkPolicy(_Strict, kw_only=True):
    """The ``[network]`` table: the mode and, for ``egress``, what the env may reach (docs/network.md)."""

    mode: Annotated[Network, Meta(description=(
        "none (default) | loopback | egress: own address, NAT through the node, only what allow names | "
        "host (trusted build steps only)."))] = DEFAULT_NETWORK
    allow: Annotated[list[NetworkEntry], Meta(max_length=MAX_NETWORK_ENTRIES, description=(
        "What an egress env may reach; everything else is dropped by the kernel."))] = []
    deny: Annotated[list[NetworkEntry], Meta(max_length=MAX_NETWORK_ENTRIES, description=(
        "Dropped even when allow covers it."))] = []
    bandwidth: Annotated[str, Meta(pattern=BANDWIDTH_PATTERN, description=(
        'Rate limit of each direction, e.g. "100Mbit".'))] | None = None
    dns: Annotated[Literal["node", "forward", "none"], Meta(description=(
        "node: a resolver on the env's gateway that answers only allowed host names; forward: it also asks "
        "the node's resolver for any other name (answers the env may not reach are dropped); none: no "
        "resolver. Default: node when allow names a host, else forward when allow opens 0.0.0.0/0, else none."))] | None = None


PORT_PATTERN = r"^[0-9]{1,5}(/(tcp|udp|sctp))?$"
MAX_IMAGE_LABELS = 1024


class ImageMeta(_Strict, kw_only=True):
    """The ``[image]`` table: what the OCI image an env was made from says beyond env, workdir and
    user (those fill the plan's own fields). Kept for the APIs that speak images (E2B templates,
    the Docker API); weenv's init never runs the image's command by itself."""

    source: Annotated[str, Meta(max_length=4096, description="The image reference it was converted from.")] = ""
    entrypoint: Annotated[list[Arg], Meta(max_length=MAX_INIT_ARGS, description="The image's Entrypoint.")] = []
    cmd: Annotated[list[Arg], Meta(max_length=MAX_INIT_ARGS, description="The image's Cmd.")] = []
    ports: Annotated[list[Annotated[str, Meta(pattern=PORT_PATTERN)]], Meta(max_length=1024, description=(
        'Exposed ports, e.g. "8080/tcp" (documentation: an env\'s network is the plan\'s).'))] = []
    labels: Annotated[dict[Annotated[str, Meta(min_length=1, max_length=1024)], Annotated[str, Meta(
        max_length=MAX_ARG_STRLEN)]], Meta(max_length=MAX_IMAGE_LABELS, description="The image's labels.")] = {}
    stop_signal: Annotated[str, Meta(max_length=32, description="The image's StopSignal.")] = ""


class Plan(_Strict, kw_only=True):
    """A weenv environment plan: what to run (groups, bottom first) and how (env, limits)."""

    name: Annotated[Name, Meta(description="Plan name; env ids and the hostname derive from it.")]
    groups: Annotated[list[Group], Meta(max_length=MAX_GROUPS, description=(
        "Layer groups, bottom (os) first, task last."))] = []
    env: Annotated[dict[EnvName, EnvValue], Meta(max_length=MAX_ENV_VARS, description=(
        "Environment variables; merged over the image's, plan values win. Each NAME=value is "
        "under 128 KiB, all of them together at most 1 MiB."
    ))] = {}
    workdir: Annotated[AbsPath, Meta(description=(
        "Working directory (absolute, normalised); default the image's, else /."))] | None = None
    user: Annotated[User, Meta(description="User of the init and of exec; default the image's, else root.")] | None = None
    init: Annotated[list[Arg], Meta(min_length=1, max_length=MAX_INIT_ARGS, description=(
        "argv of the long-lived process (at most 512 KiB in all); default weenv's tiny idle init."
    ))] | None = None
    resources: Resources = Resources()
    network: Annotated[Network | NetworkPolicy, Meta(description=(
        "none: an empty network namespace; loopback: the same with lo up (127.0.0.1 works); "
        "egress: a table with allow/deny lists (docs/network.md); "
        "host: the node's own network (egress, for trusted build and packaging steps only)."
    ))] = DEFAULT_NETWORK
    ttl_s: Annotated[float, Meta(gt=0, le=MAX_TTL_S, description=(
        "Seconds until the env is killed (at most 30 days); default: no TTL."))] | None = None
    mounts: Annotated[list[Mount], Meta(max_length=MAX_MOUNTS, description="Read-only host bind mounts.")] = []
    volumes: Annotated[list[VolumeMount], Meta(max_length=MAX_VOLUMES, description=(
        "Volumes of the node mounted into the env: persistent, shared by the envs that mount them."))] = []
    snapshot: Annotated[str, Meta(pattern=SNAPSHOT_PATTERN, description=(
        "Snapshot id to start from (reserved for snapshots); groups may then be empty."
    ))] | None = None
    runtime: Annotated[RuntimeName, Meta(description=(
        "crun: a container (fast, dense); gvisor: the gVisor sandbox (runsc) for code nobody trusts, "
        "network none or loopback only (docs/security.md). Default: the node's (weenv daemon --runtime)."
    ))] | None = None
    image: Annotated[ImageMeta, Meta(description=(
        "Set when the plan was made from an OCI image (weenv pull, weenv up IMAGE): its command, "
        "exposed ports and labels."))] | None = None
    setuid: Annotated[bool, Meta(description=(
        "Let setuid binaries (sudo, su) raise a process's privileges inside the env: its processes run "
        "without no_new_privileges. Never beyond the env's root: the same capability bounding set, seccomp "
        "filter, user namespace and mounts (docs/security.md). Default false."))] = False


class Lock(Plan, kw_only=True):
    """A plan whose every group is pinned to digests (``lock_version`` marks a lock file)."""

    lock_version: Annotated[int, Meta(ge=1, description="Lock format version; this weenv writes 1.")]
    groups: Annotated[list[LockedGroup], Meta(max_length=MAX_GROUPS, description="Pinned groups, bottom first.")] = []


class ResolvedGroup(msgspec.Struct, frozen=True, kw_only=True):
    """What a resolver returns for a ref: the digests a lock pins. ``registry`` is ``None`` for
    the embedded local store. Any object with these attributes will do (e.g. the registry's
    ``GroupInfo``)."""

    manifest_digest: str
    layer_digest: str
    layer_size: int
    toc_digest: str
    registry: str | None
    repo: str


def network_policy(plan: Plan) -> NetworkPolicy:
    """The plan's network as a table, whether it was written short (``network = "none"``) or not."""
    net = plan.network
    return net if isinstance(net, NetworkPolicy) else NetworkPolicy(mode=net)  # type: ignore[arg-type]


def group_class_rank(group_class: str) -> int:
    """0 for ``os`` … 4 for ``task``."""
    return GROUP_CLASSES.index(group_class)


def plan_fields(plan: Plan) -> dict[str, Any]:
    """The plan's fields by attribute name (shallow), without the lock-only ones."""
    return {f: getattr(plan, f) for f in Plan.__struct_fields__}
