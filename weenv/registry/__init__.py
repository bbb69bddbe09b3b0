"""Stores of weenv layer groups: remote OCI registries and local OCI image-layout directories."""

from ._store import BlobReader as BlobReader
from ._store import Descriptor as Descriptor
from ._store import Store as Store
