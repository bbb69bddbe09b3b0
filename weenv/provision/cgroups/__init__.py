"""The cgroup seam of weenv: one small interface, two implementations (v1, v2); the in-memory fake
for unit tests is :class:`weenv.testing.FakeBackend`.

:func:`detect_backend` picks v1 or v2 from the host's mounts and places weenv's parent group under
this process's own cgroup in every hierarchy; weenv creates groups nowhere else.
"""

from ._base import ALL_FEATURES as ALL_FEATURES
from ._base import PAGE_BYTES as PAGE_BYTES
from ._base import Cgroup as Cgroup
from ._base import CgroupBackend as CgroupBackend
from ._base import CgroupSample as CgroupSample
from ._base import check_name as check_name
from ._detect import CgroupLayout as CgroupLayout
from ._detect import detect_backend as detect_backend
from ._detect import parse_layout as parse_layout
from ._fs import CgroupFs as CgroupFs
from ._v1 import V1Backend as V1Backend
from ._v1 import V1Cgroup as V1Cgroup
from ._v2 import V2Backend as V2Backend
from ._v2 import V2Cgroup as V2Cgroup

__all__ = ["ALL_FEATURES", "Cgroup", "CgroupBackend", "CgroupFs", "CgroupLayout", "CgroupSample", "PAGE_BYTES",
           "V1Backend", "V1Cgroup", "V2Backend", "V2Cgroup", "check_name", "detect_backend", "parse_layout"]
