"""A job's folders: its work directory (with ``input/`` and ``output/``) and its ``logs/``."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import PathNotFoundError

__all__ = ["prepare_workdir"]


def prepare_workdir(root: Path, job_id: int, workdir: str | os.PathLike[str] | None) -> Path:
    """The job's work directory (created with ``input/`` and ``output/``) and its logs folder.

    ``root`` is the workspace folder; with no ``workdir`` the job works in ``<root>/jobs/<id>``.
    """
    logs = root / "jobs" / str(job_id) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if workdir is None:
        wd = root / "jobs" / str(job_id)
    else:
        wd = Path(workdir).expanduser().resolve()
        if not wd.is_dir():
            raise PathNotFoundError(f"workdir {str(workdir)!r} is not an existing directory")
    (wd / "input").mkdir(parents=True, exist_ok=True)
    (wd / "output").mkdir(parents=True, exist_ok=True)
    return wd.resolve()
