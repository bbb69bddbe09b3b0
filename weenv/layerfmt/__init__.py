"""The weenv layer format: a valid tar+zstd OCI layer with a table of contents at its tail.

This package does no network or FUSE I/O: bytes arrive through a :class:`RandomAccessReader`
(``size``, ``read_at``) and leave through a writer. See docs/layer-format.md.
"""

from ._build import BuildResult as BuildResult
from ._build import build_entries as build_entries
from ._build import build_layer as build_layer
from ._errors import EntryNotFoundError as EntryNotFoundError
from ._errors import IntegrityError as IntegrityError
from ._errors import LayerError as LayerError
from ._errors import LayerFormatError as LayerFormatError
from ._errors import LayerInputError as LayerInputError
from ._errors import LimitExceededError as LimitExceededError
from ._errors import TruncatedLayerError as TruncatedLayerError
from ._errors import UnsafePathError as UnsafePathError
from ._io import BytesReader as BytesReader
from ._io import FileReader as FileReader
from ._io import RandomAccessReader as RandomAccessReader
from ._reader import DEFAULT_TAIL_READ as DEFAULT_TAIL_READ
from ._reader import Layer as Layer
from ._reader import decode_chunk as decode_chunk
from ._reader import decompress_chunk as decompress_chunk
from ._reader import normalize_lookup as normalize_lookup
from ._reader import read_tail as read_tail
from ._reader import verify_chunk as verify_chunk
from ._source import SourceEntry as SourceEntry
from ._source import scan_directory as scan_directory
from ._source import scan_tar as scan_tar
from ._toc import DEFAULT_CHUNK_SIZE as DEFAULT_CHUNK_SIZE
from ._toc import TYPE_NAMES as TYPE_NAMES
from ._toc import Columns as Columns
from ._toc import DEFAULT_LIMITS as DEFAULT_LIMITS
from ._toc import FOOTER_SIZE as FOOTER_SIZE
from ._toc import FORMAT_VERSION as FORMAT_VERSION
from ._toc import MEDIA_TYPE as MEDIA_TYPE
from ._toc import OPAQUE_NAME as OPAQUE_NAME
from ._toc import TOC as TOC
from ._toc import TOC_DIGEST_ANNOTATION as TOC_DIGEST_ANNOTATION
from ._toc import WHITEOUT_PREFIX as WHITEOUT_PREFIX
from ._toc import Chunk as Chunk
from ._toc import Entry as Entry
from ._toc import Footer as Footer
from ._toc import Limits as Limits

__all__ = ["BuildResult", "BytesReader", "Chunk", "Columns", "DEFAULT_CHUNK_SIZE", "DEFAULT_LIMITS",
           "DEFAULT_TAIL_READ", "Entry", "EntryNotFoundError", "FOOTER_SIZE", "FORMAT_VERSION", "FileReader", "Footer",
           "IntegrityError", "Layer", "LayerError", "LayerFormatError", "LayerInputError", "LimitExceededError",
           "Limits", "MEDIA_TYPE", "OPAQUE_NAME", "RandomAccessReader", "SourceEntry", "TOC", "TOC_DIGEST_ANNOTATION",
           "TYPE_NAMES", "TruncatedLayerError", "UnsafePathError", "WHITEOUT_PREFIX", "build_entries", "build_layer",
           "decode_chunk", "decompress_chunk", "normalize_lookup", "read_tail", "scan_directory", "scan_tar",
           "verify_chunk"]
