"""slime integration: weenv sandboxes for agentic RL rollouts (see docs/slime.md).

- :class:`WeenvSandbox` (``slime_plugin.sandbox``): slime's ``Sandbox`` protocol over a weenv env.
- ``slime_plugin.rollout.generate`` / ``slime_plugin.rollout.reward``: the functions to give slime's
  ``--custom-generate-function-path`` and ``--custom-rm-path``.
- Tool-call parsers (:class:`ToolCallParser`, ``bash`` and ``hermes`` built in) and the settings
  (:class:`EnvSpec`, :class:`RolloutSettings`) those functions read.

slime itself is not a dependency: the plugin reads slime's ``args`` and ``Sample`` by attribute.
"""

from ._config import EnvSpec as EnvSpec
from ._config import EvaluatorSpec as EvaluatorSpec
from ._config import RolloutSettings as RolloutSettings
from ._config import resolve_env_spec as resolve_env_spec
from ._config import resolve_rollout_settings as resolve_rollout_settings
from ._errors import CapacityError as CapacityError
from ._errors import CommandFailedError as CommandFailedError
from ._errors import ConfigError as ConfigError
from ._errors import GenerationAborted as GenerationAborted
from ._errors import GenerationError as GenerationError
from ._errors import GradingError as GradingError
from ._errors import SandboxError as SandboxError
from ._errors import SandboxNotStartedError as SandboxNotStartedError
from ._errors import SlimePluginError as SlimePluginError
from ._errors import SnapshotUnavailableError as SnapshotUnavailableError
from ._parsers import Action as Action
from ._parsers import BashBlockParser as BashBlockParser
from ._parsers import CallResult as CallResult
from ._parsers import HermesToolCallParser as HermesToolCallParser
from ._parsers import ToolCall as ToolCall
from ._parsers import ToolCallParser as ToolCallParser
from ._parsers import load_parser as load_parser
from .sandbox import WeenvSandbox as WeenvSandbox

__all__ = ["Action", "BashBlockParser", "CallResult", "CapacityError", "CommandFailedError", "ConfigError", "EnvSpec",
           "EvaluatorSpec", "GenerationAborted", "GenerationError", "GradingError", "HermesToolCallParser",
           "RolloutSettings", "SandboxError", "SandboxNotStartedError", "SlimePluginError", "SnapshotUnavailableError",
           "ToolCall", "ToolCallParser", "WeenvSandbox", "load_parser", "resolve_env_spec", "resolve_rollout_settings"]
