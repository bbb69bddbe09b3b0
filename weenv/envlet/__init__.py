"""The envlet: a FUSE daemon serving registered layers lazily through ordered chunk tiers (memory, disk, registry)."""

from ._cache import DiskCache as DiskCache
from ._cache import MemoryCache as MemoryCache
from ._control import EnvletClient as EnvletClient
from ._control import LayerInfo as LayerInfo
from ._control import StoreSpec as StoreSpec
from ._errors import ChunkIntegrityError as ChunkIntegrityError
from ._errors import ControlError as ControlError
from ._errors import EnvletError as EnvletError
from ._errors import EnvletUnavailableError as EnvletUnavailableError
from ._errors import FetchError as FetchError
from ._errors import LayerNotFoundError as LayerNotFoundError
from ._fetch import Fetcher as Fetcher
from ._fetch import LayerSource as LayerSource
from ._metrics import Metrics as Metrics
from ._process import EnvletProcess as EnvletProcess
from ._server import clear_stale_mount as clear_stale_mount
from ._tier import ChunkTier as ChunkTier
from ._tier import TierConfig as TierConfig
from ._tier import TierConfigError as TierConfigError
from ._tier import load_tiers as load_tiers
from ._server import serve as serve
from ._tree import LayerTree as LayerTree

__all__ = ["ChunkIntegrityError", "ChunkTier", "ControlError", "DiskCache", "EnvletClient", "EnvletError",
           "EnvletProcess", "EnvletUnavailableError", "FetchError", "Fetcher", "LayerInfo", "LayerNotFoundError",
           "LayerSource", "LayerTree", "MemoryCache", "Metrics", "StoreSpec", "TierConfig", "TierConfigError",
           "clear_stale_mount", "load_tiers", "serve"]
