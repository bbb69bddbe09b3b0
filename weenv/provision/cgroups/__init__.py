"""The cgroup seam of weenv: one small interface, three implementations (v1, v2, fake).

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
from ._fake import FakeBackend as FakeBackend
from ._fake import FakeCgroup as FakeCgroup
from ._fs import CgroupFs as CgroupFs
from ._v1 import V1Backend as V1Backend
from ._v1 import V1Cgroup as V1Cgroup
from ._v2 import V2Backend as V2Backend
from ._v2 import V2Cgroup as V2Cgroup

__all__ = [name for name in dir() if not name.startswith("_")]
