"""Building envs' layers on the host and in envs: ``weenv build`` (RUN/COPY steps over a base lock,
a step cache, squashing), ``weenv package`` (a git repository at a commit becomes a ``task`` group)
and locking a plan with the defaults its image carries.

Errors (one tree, drawn in :mod:`weenv.build._package`)::

    WeenvError
     └── BuildError
          ├── StepFailedError   a RUN step exited non-zero (its output's tail in the message)
          └── PackageError      a task cannot be packaged
               └── TasksFileError
"""

from ._build import BuildError as BuildError
from ._build import StepFailedError as StepFailedError
from ._build import build as build
from ._locking import lock_with_image_defaults as lock_with_image_defaults
from ._package import PackageError as PackageError
from ._package import TaskRecord as TaskRecord
from ._package import TasksFileError as TasksFileError
from ._package import check_lock as check_lock
from ._package import default_results_path as default_results_path
from ._package import is_git_url as is_git_url
from ._package import load_tasks as load_tasks
from ._package import package as package
from ._package import package_tasks as package_tasks
from ._package import plan_name as plan_name
from ._package import read_results as read_results

__all__ = [
    "BuildError", "PackageError", "StepFailedError", "TaskRecord", "TasksFileError", "build", "check_lock",
    "default_results_path", "is_git_url", "load_tasks", "lock_with_image_defaults", "package", "package_tasks",
    "plan_name", "read_results",
]
