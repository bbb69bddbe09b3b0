"""Environment plans and locks: strict msgspec Structs read from TOML (people) or JSON (programs).

A :class:`Plan` names the layer groups of an environment (bottom first) and how it runs; a
:class:`Lock` is a plan whose every group is pinned to manifest, layer and TOC digests, so starting
from it never resolves a tag. Errors name the file and the field (``plan.toml: groups[2].ref: …``).
See docs/plan.md; the JSON Schema is docs/plan.schema.json.
"""

from ._codec import dump_json_schema as dump_json_schema
from ._codec import dump_plan as dump_plan
from ._codec import format_for_path as format_for_path
from ._codec import is_locked as is_locked
from ._codec import load_any as load_any
from ._codec import load_lock as load_lock
from ._codec import load_plan as load_plan
from ._codec import load_text as load_text
from ._codec import parse_document as parse_document
from ._codec import plan_from_builtins as plan_from_builtins
from ._codec import plan_json_schema as plan_json_schema
from ._codec import plan_to_builtins as plan_to_builtins
from ._codec import write_plan as write_plan
from ._errors import LockError as LockError
from ._errors import PlanError as PlanError
from ._errors import PlanSyntaxError as PlanSyntaxError
from ._errors import PlanValidationError as PlanValidationError
from ._errors import Problem as Problem
from ._lock import Resolver as Resolver
from ._lock import ResolvedGroupLike as ResolvedGroupLike
from ._lock import lock_plan as lock_plan
from ._lock import verify_lock_group as verify_lock_group
from ._lock import verify_manifest as verify_manifest
from ._model import DEFAULT_CPU_MAX_CORES as DEFAULT_CPU_MAX_CORES
from ._model import DEFAULT_CPU_MIN_CORES as DEFAULT_CPU_MIN_CORES
from ._model import DEFAULT_DISK_BYTES as DEFAULT_DISK_BYTES
from ._model import DEFAULT_MEMORY_MAX_BYTES as DEFAULT_MEMORY_MAX_BYTES
from ._model import DEFAULT_MEMORY_MIN_BYTES as DEFAULT_MEMORY_MIN_BYTES
from ._model import DEFAULT_NETWORK as DEFAULT_NETWORK
from ._model import DEFAULT_PIDS as DEFAULT_PIDS
from ._model import GROUP_CLASSES as GROUP_CLASSES
from ._model import LOCK_VERSION as LOCK_VERSION
from ._model import MAX_ARG_STRLEN as MAX_ARG_STRLEN
from ._model import MAX_CORES as MAX_CORES
from ._model import MAX_DISK_BYTES as MAX_DISK_BYTES
from ._model import MAX_ENV_BYTES as MAX_ENV_BYTES
from ._model import MAX_ENV_VARS as MAX_ENV_VARS
from ._model import MAX_GROUPS as MAX_GROUPS
from ._model import MAX_INIT_ARGS as MAX_INIT_ARGS
from ._model import MAX_INIT_BYTES as MAX_INIT_BYTES
from ._model import MAX_LAYER_BYTES as MAX_LAYER_BYTES
from ._model import MAX_MEMORY_BYTES as MAX_MEMORY_BYTES
from ._model import MAX_MOUNTS as MAX_MOUNTS
from ._model import MAX_VOLUMES as MAX_VOLUMES
from ._model import VolumeMount as VolumeMount
from ._model import MAX_PIDS as MAX_PIDS
from ._model import MAX_TTL_S as MAX_TTL_S
from ._model import CpuRange as CpuRange
from ._model import Group as Group
from ._model import ImageMeta as ImageMeta
from ._model import Lock as Lock
from ._model import LockedGroup as LockedGroup
from ._model import MemoryRange as MemoryRange
from ._model import Mount as Mount
from ._model import Plan as Plan
from ._model import ResolvedGroup as ResolvedGroup
from ._model import Resources as Resources
from ._overrides import apply_image_defaults as apply_image_defaults
from ._overrides import apply_overrides as apply_overrides
from ._overrides import plan_defaults_from_image as plan_defaults_from_image
from ._ref import Reference as Reference
from ._ref import parse_ref as parse_ref
from ._units import format_size as format_size
from ._units import parse_cpu_range as parse_cpu_range
from ._units import parse_memory_range as parse_memory_range
from ._units import parse_size as parse_size

from ._validate import HOST_PATHS as HOST_PATHS
from ._validate import exposed_host_path as exposed_host_path

__all__ = ["CpuRange", "DEFAULT_CPU_MAX_CORES", "DEFAULT_CPU_MIN_CORES", "DEFAULT_DISK_BYTES",
           "DEFAULT_MEMORY_MAX_BYTES", "DEFAULT_MEMORY_MIN_BYTES", "DEFAULT_NETWORK", "DEFAULT_PIDS", "GROUP_CLASSES",
           "Group", "HOST_PATHS", "ImageMeta", "LOCK_VERSION", "Lock", "LockError", "LockedGroup", "MAX_ARG_STRLEN", "MAX_CORES",
           "MAX_DISK_BYTES", "MAX_ENV_BYTES", "MAX_ENV_VARS", "MAX_GROUPS", "MAX_INIT_ARGS", "MAX_INIT_BYTES",
           "MAX_LAYER_BYTES", "MAX_MEMORY_BYTES", "MAX_MOUNTS", "MAX_PIDS", "MAX_TTL_S", "MAX_VOLUMES", "MemoryRange",
           "Mount",
           "Plan", "PlanError", "PlanSyntaxError", "PlanValidationError", "Problem", "Reference", "ResolvedGroup",
           "ResolvedGroupLike", "Resolver", "Resources", "apply_image_defaults", "apply_overrides", "dump_json_schema",
           "dump_plan", "exposed_host_path", "format_for_path", "format_size", "is_locked", "load_any", "load_lock",
           "load_plan", "load_text", "lock_plan", "parse_cpu_range", "parse_document", "parse_memory_range",
           "parse_ref", "parse_size", "plan_defaults_from_image", "plan_from_builtins", "plan_json_schema",
           "plan_to_builtins", "verify_lock_group", "verify_manifest", "VolumeMount", "write_plan"]
