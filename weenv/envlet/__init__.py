"""The envlet: a FUSE daemon that serves registered layers lazily through a three-tier chunk cache."""

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
from ._server import serve as serve
from ._tree import LayerTree as LayerTree

__all__ = ["ChunkIntegrityError", "ControlError", "DiskCache", "EnvletClient", "EnvletError", "EnvletProcess",
           "EnvletUnavailableError", "FetchError", "Fetcher", "LayerInfo", "LayerNotFoundError", "LayerSource",
           "LayerTree", "MemoryCache", "Metrics", "StoreSpec", "clear_stale_mount", "serve"]
