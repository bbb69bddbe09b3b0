"""Stores of weenv layer groups: remote OCI registries and local OCI image-layout directories.

See docs/registry.md for REF forms, auth, the store layout and the artifact format.
"""

from ._convert import ConvertedImage as ConvertedImage
from ._convert import ConvertedLayer as ConvertedLayer
from ._convert import convert_image as convert_image
from ._convert import image_lock as image_lock
from ._convert import is_image_ref as is_image_ref
from ._convert import lock_for_image as lock_for_image
from ._errors import ArtifactError as ArtifactError
from ._errors import AuthError as AuthError
from ._errors import BlobRangeError as BlobRangeError
from ._errors import IntegrityError as IntegrityError
from ._errors import NotFoundError as NotFoundError
from ._errors import ProtocolError as ProtocolError
from ._errors import RefError as RefError
from ._errors import RegistryError as RegistryError
from ._errors import RegistryUnavailableError as RegistryUnavailableError
from ._errors import StoreError as StoreError
from ._errors import mapped_errors as mapped_errors
from ._group import GroupInfo as GroupInfo
from ._group import ImageConfig as ImageConfig
from ._group import image_config as image_config
from ._group import local_store_path as local_store_path
from ._group import open_layer_ref as open_layer_ref
from ._group import open_store as open_store
from ._group import resolve_group as resolve_group
from ._image import ExportResult as ExportResult
from ._image import PulledGroup as PulledGroup
from ._image import PullResult as PullResult
from ._image import export_oci as export_oci
from ._image import parse_groups_spec as parse_groups_spec
from ._image import pull as pull
from ._layout import LayoutStore as LayoutStore
from ._oci import GROUP_ARTIFACT_TYPE as GROUP_ARTIFACT_TYPE
from ._oci import GROUP_CLASSES as GROUP_CLASSES
from ._publish import PublishResult as PublishResult
from ._publish import publish as publish
from ._publish import publish_layer_file as publish_layer_file
from ._ref import Ref as Ref
from ._ref import parse_ref as parse_ref
from ._remote import RemoteStore as RemoteStore
from ._retry import RetryPolicy as RetryPolicy
from ._store import BlobReader as BlobReader
from ._store import Descriptor as Descriptor
from ._store import Store as Store

__all__ = [
    "ArtifactError", "AuthError", "BlobRangeError", "BlobReader", "ConvertedImage", "ConvertedLayer", "Descriptor",
    "ExportResult", "GROUP_ARTIFACT_TYPE", "GROUP_CLASSES", "GroupInfo", "ImageConfig", "IntegrityError",
    "LayoutStore", "NotFoundError", "ProtocolError", "PublishResult", "PullResult", "PulledGroup", "Ref",
    "RefError", "RegistryError", "RegistryUnavailableError", "RemoteStore", "RetryPolicy", "Store", "StoreError",
    "convert_image", "export_oci", "image_config", "image_lock", "is_image_ref", "local_store_path", "lock_for_image",
    "mapped_errors", "open_layer_ref", "open_store", "parse_groups_spec", "parse_ref", "publish",
    "publish_layer_file", "pull", "resolve_group",
]
