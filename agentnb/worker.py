"""The worker: claims queued jobs and runs them; builds the enriched instruction.

The enriched instruction is the first user message's opening: a date-time block,
the last 5 comments of the job (each cut to 500 characters, with a visible
marker), a listing of ``input/`` and ``output/`` (names and sizes, never
contents) and the job's instruction.  Older comments, earlier movements'
conversations, logs and file contents are deliberately left out.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from .engine.prompts import text

if TYPE_CHECKING:
    from .workspace import Job, Workspace

__all__ = [
    "MAX_COMMENTS",
    "MAX_COMMENT_CHARS",
    "Terminated",
    "Worker",
    "build_enriched_instruction",
    "sigterm_interrupts",
]

MAX_COMMENTS = 5
MAX_COMMENT_CHARS = 500
MAX_LISTED_FILES = 50


def _now_block(language: str, now: datetime | None = None) -> str:
    now = now or datetime.now().astimezone()
    tz = now.tzname() or "UTC"
    return f"{text(language, 'time')}\n{now.strftime('%Y-%m-%d %H:%M')} ({now.strftime('%A')}, {tz})"


def _comment_block(comments: list[dict[str, Any]], total: int, language: str) -> str:
    lines = [text(language, "comments", shown=len(comments), total=total)]
    for c in comments:
        body = c["body"]
        if len(body) > MAX_COMMENT_CHARS:
            body = body[:MAX_COMMENT_CHARS] + " " + text(language, "cut", shown=MAX_COMMENT_CHARS, total=len(body))
        when = datetime.fromtimestamp(c["ts"], tz=timezone.utc).astimezone().strftime("%Y-%m-%d %H:%M")
        lines.append(f"- [{c['author']}, {when}] {body}")
    return "\n".join(lines)


def _listing(folder: Path, label: str, language: str) -> list[str]:
    lines = [f"{label}/"]
    entries: list[tuple[str, int]] = []
    # what the tools cannot reach is not listed either: a linked input/ (or a link in it) that leads
    # out of the work directory would show the names of outside files
    root = os.path.realpath(folder.parent)

    def inside(p: Path) -> bool:
        return os.path.realpath(p).startswith(root + os.sep)

    if folder.is_dir() and inside(folder):
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames.sort()
            for name in sorted(filenames):
                p = Path(dirpath) / name
                if not inside(p):
                    continue
                try:
                    entries.append((p.relative_to(folder).as_posix(), p.stat().st_size))
                except OSError:
                    continue
    if not entries:
        lines.append(f"  {text(language, 'empty')}")
    for rel, size in entries[:MAX_LISTED_FILES]:
        lines.append(f"  - {rel} ({size:,} bytes)")
    if len(entries) > MAX_LISTED_FILES:
        lines.append("  " + text(language, "more_files", n=len(entries) - MAX_LISTED_FILES))
    return lines


def build_enriched_instruction(
    *,
    instruction: str,
    comments: list[dict[str, Any]],
    total_comments: int,
    workdir: Path,
    language: str = "en",
    now: datetime | None = None,
) -> str:
    """The opening of every movement's user prompt for one activation of a job."""
    blocks = [_now_block(language, now)]
    if comments:
        blocks.append(_comment_block(comments, total_comments, language))
    files = [text(language, "workspace")]
    files += _listing(workdir / "input", "input", language)
    files += _listing(workdir / "output", "output", language)
    blocks.append("\n".join(files))
    blocks.append(f"{text(language, 'task')}\n{instruction}")
    return "\n\n".join(blocks)


class Terminated(SystemExit):
    """A SIGTERM, raised in the main thread while a worker runs (the exit status is 128 + 15)."""


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While inside, SIGTERM interrupts the main thread as Ctrl-C does, so the running job is re-queued.

    Without it SIGTERM (``kill``, ``systemctl stop``, a container shutting down) ends the process
    where it stands and the job stays ``running`` until a later claim notices its owner is gone.
    Only the main thread can receive signals: elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def interrupt(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if fired:  # a second SIGTERM must not cut short the re-queueing the first one started
            return
        fired = True
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


class Worker:
    """Claims queued jobs one at a time and runs each until it ends or waits.

    SIGTERM (like Ctrl-C) gives the running job back to the queue, resumable, and raises
    :class:`Terminated`.
    """

    def __init__(self, workspace: Workspace) -> None:
        self.ws = workspace

    def run_once(self) -> Job | None:
        """Claim the oldest queued job and run it; ``None`` when the queue is empty."""
        with sigterm_interrupts():
            row = self.ws.store.claim()
            if row is None:
                return None
            return self.ws._run_claimed(row, unit="job")

    def run(self, *, forever: bool = False, poll: float = 1.0, max_jobs: int | None = None) -> int:
        """Run queued jobs until none is left (or forever, polling); returns how many ran."""
        done = 0
        with sigterm_interrupts():
            while max_jobs is None or done < max_jobs:
                job = self.run_once()
                if job is None:
                    if not forever:
                        break
                    time.sleep(poll)
                    continue
                done += 1
        return done
