"""Building envs' layers on the host and in envs: ``weenv build`` (RUN/COPY steps over a base lock,
a step cache, squashing), ``weenv package`` (a git repository at a commit becomes a ``task`` group)
and locking a plan with the defaults its image carries.

Errors (one tree, drawn in :mod:`weenv.build._package`; the package ones in ``_package_errors``)::

    WeenvError
     └── BuildError
          ├── StepFailedError   a RUN step exited non-zero (its output's tail in the message)
          ├── DockerfileError   a Dockerfile weenv does not build (names the file and line)
          └── PackageError      a task cannot be packaged
               └── TasksFileError
"""

from ._build import BuildError as BuildError
from ._build import StepFailedError as StepFailedError
from ._build import build as build
from ._dockerbuild import DockerBuildResult as DockerBuildResult
from ._dockerbuild import build_dockerfile as build_dockerfile
from ._dockerfile import DockerfileError as DockerfileError
from ._locking import lock_with_image_defaults as lock_with_image_defaults
from ._git import is_git_url as is_git_url
from ._package import package as package
from ._package import plan_name as plan_name
from ._package_errors import PackageError as PackageError
from ._package_errors import TasksFileError as TasksFileError
from ._tasks import TaskRecord as TaskRecord
from ._tasks import check_lock as check_lock
from ._tasks import default_results_path as default_results_path
from ._tasks import load_tasks as load_tasks
from ._tasks import package_tasks as package_tasks
from ._tasks import read_results as read_results

__all__ = [
    "BuildError", "DockerBuildResult", "DockerfileError", "PackageError", "StepFailedError", "TaskRecord",
    "TasksFileError", "build", "build_dockerfile", "check_lock",
    "default_results_path", "is_git_url", "load_tasks", "lock_with_image_defaults", "package", "package_tasks",
    "plan_name", "read_results",
]
