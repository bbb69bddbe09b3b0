"""Owner ids of a layer as a node stores them when envs run in a user namespace (pure functions).

With user namespaces (docs/security.md, "User namespaces") an env's ids 0..65535 are host ids
``base``..``base+65535``. Whatever the node keeps on its disk for envs (layer trees, snapshot
trees, the files envs write) is owned by the host ids, so that a setuid-root file is setuid to
an unprivileged host uid and a file capability belongs to the env's root, not the host's; a
layer, made from such a tree, records the env's ids again.

File capabilities (``security.capability``): version 2 applies to every user namespace; version
3 names the host uid of the root it belongs to (``rootid``). On the host side a v2 capability
becomes v3 with ``rootid = base`` (what the kernel writes when the env's root sets one), and
back: a v3 capability of ``base`` is recorded as v2.
"""

from __future__ import annotations

import struct

ID_COUNT = 65536
#: env id that layer ids beyond the range show as (nobody), and the host-side stand-in for them
OVERFLOW_ID = 65534
CAPABILITY_XATTR = "security.capability"

_V2 = 0x02000000
_V3 = 0x03000000
_REVISION_MASK = 0xFF000000
_V2_SIZE = 20
_V3_SIZE = 24


def to_host_id(layer_id: int, base: int) -> int:
    """The host id a layer's owner id is stored as (``base`` 0: no user namespace, unchanged)."""
    if base == 0:
        return layer_id
    return base + (layer_id if 0 <= layer_id < ID_COUNT else OVERFLOW_ID)


def to_layer_id(host_id: int, base: int) -> int:
    """The layer's id for a host id (ids outside the range are nobody's: they cannot have been
    written by the env, and must not become root in a layer)."""
    if base == 0:
        return host_id
    rel = host_id - base
    return rel if 0 <= rel < ID_COUNT else OVERFLOW_ID


def cap_to_host(value: bytes, base: int) -> bytes:
    """A layer's ``security.capability`` value as a node stores it for envs of ``base``."""
    if base == 0 or len(value) < _V2_SIZE:
        return value
    (magic,) = struct.unpack_from("<I", value)
    rev = magic & _REVISION_MASK
    if rev == _V2:
        return struct.pack("<I", (magic & ~_REVISION_MASK) | _V3) + value[4:_V2_SIZE] + struct.pack("<I", base)
    if rev == _V3 and len(value) >= _V3_SIZE:
        (rootid,) = struct.unpack_from("<I", value, _V2_SIZE)
        return value[:_V2_SIZE] + struct.pack("<I", to_host_id(rootid, base))
    return value


def cap_to_layer(value: bytes, base: int) -> bytes:
    """The inverse of :func:`cap_to_host`: a v3 capability of the env's root becomes v2."""
    if base == 0 or len(value) < _V3_SIZE:
        return value
    (magic,) = struct.unpack_from("<I", value)
    if magic & _REVISION_MASK != _V3:
        return value
    (rootid,) = struct.unpack_from("<I", value, _V2_SIZE)
    rel = to_layer_id(rootid, base)
    if rel == 0:
        return struct.pack("<I", (magic & ~_REVISION_MASK) | _V2) + value[4:_V2_SIZE]
    return value[:_V2_SIZE] + struct.pack("<I", rel)
