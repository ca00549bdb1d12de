"""Two runs side by side (docs/fork-compare.md#compare): :class:`Comparison`, what ``ws.compare(a, b)`` returns.

The runs are aligned by movement-run position (``seq`` 1, 2, …): a fork re-serves its original's first runs
at the same positions, so position ``n`` of both jobs is the same step of the same workflow.  A position is
*identical* when both jobs ran the same movement there and had the same conversation in it — the same
responses (content, and tool calls by name and arguments; a compaction's summarisation call is a response,
told apart from the conversation's by its purpose, and each compaction's summary and the messages it removed
and kept count too), the same tool results, the same transition —
whatever the timestamps, event and call ids, latencies and token counts (a fork's re-served calls count 0
tokens, as nothing was spent, yet they are the same calls) — and the same prompts, apart from the date and
time they open with (a fork and a replay keep their original's, but two separate runs do not), so a fork that
edits a movement's persona or instruction differs there even when its model answers the same.  A subtask is
compared by its instruction and piece (a fork's re-served subtasks are ``replay:`` jobs of the original's).

Everything is read from the store when asked for (``frame``, ``files()``, the HTML), like a ``Job``: a
comparison kept in a variable shows the jobs as they are now.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ._fs import special_kind
from .engine.jobfiles import pull_files
from .engine.prompts import clock_block
from .errors import ToolError
from .events import Compaction, LLMResponse, MovementStart, Transition
from .tools.paths import open_regular, unlinked_path
from .views.compare_html import ForkNote, comparison_html
from .views.render import DEFAULT_MAX_BYTES, DEFAULT_MAX_CALLS, DEFAULT_MAX_CHARS
from .views.timeline import MovementRun, Timeline, ToolUse, fold

# pandas is imported inside the functions that use it: `import agentnb` (and so the CLI's start) stays light
if TYPE_CHECKING:
    import pandas as pd

    from .views.frames import Frames
    from .views.source import JobSource

__all__ = ["CHANGES", "FILE_COLUMNS", "MAX_DIFF_BYTES", "RUN_FIELDS", "Comparison"]

# per side, in this order, suffixed _a and _b; then identical and diverged
RUN_FIELDS: Final = ("movement", "next_step", "forced", "llm_calls", "total_tokens", "cost_usd", "summary", "replayed")
_RUN_DTYPES: Final[dict[str, str]] = {
    "movement": "string", "next_step": "string", "forced": "boolean", "llm_calls": "Int64",
    "total_tokens": "Int64", "cost_usd": "float64", "summary": "string", "replayed": "boolean",
}
FILE_COLUMNS: Final = ("path", "change", "size_a", "size_b", "diff")
CHANGES: Final = ("added", "removed", "changed", "same")  # the categories of files()' change
# a text file larger than this (on either side) is compared, but not diffed: its diff is None
MAX_DIFF_BYTES: Final = 2_000_000


@dataclass(frozen=True)
class _Run:
    """What one job did in one movement run: the frame's columns and the conversation compared."""

    movement: str
    next_step: str | None
    forced: bool | None
    llm_calls: int
    total_tokens: int
    summary: str | None
    replayed: bool
    conversation: tuple[Any, ...]


def _arguments(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


# what each item of a run's calls says in its conversation (kinds not named here say nothing)
_SAID: dict[type, Callable[[Any], tuple[Any, ...] | None]] = {
    # a compaction's summarisation call (docs/context.md#compaction) is a response too, told apart by its purpose: two runs
    # that compacted differently (or only one of them) are not the same conversation
    LLMResponse: lambda ev: ("response", ev.purpose, ev.content or "",
                             tuple((c.name, _arguments(c.arguments)) for c in ev.tool_calls)),
    # what the conversation went on from; the token sizes are counts, ignored like the others
    Compaction: lambda ev: ("compaction", ev.removed_messages, ev.kept_messages, ev.summary),
    ToolUse: lambda use: None if use.result is None else ("result", use.tool, use.result.content,
                                                          use.result.is_error),
    # a subtask's job id is the id of another job, different in every run
    Transition: lambda ev: ("transition", ev.movement, ev.next_step, ev.summary, ev.lessons, ev.forced, ev.reason,
                            ev.question, ev.feedback, tuple((s.instruction, s.piece) for s in ev.subtasks or ())),
}


def _conversation(run: MovementRun, start: MovementStart) -> tuple[Any, ...]:
    said = (_SAID[type(item)](item) for call in run.calls for item in call.items if type(item) in _SAID)
    return (start.movement, start.system, _without_clock(start.user), *(s for s in said if s is not None))


def _runs(tl: Timeline) -> dict[int, _Run]:
    """A job's movement runs by ``seq``, each with its conversation as a comparable tuple (a run whose start was
    never recorded has nothing to align it by)."""
    return {seq: _Run(movement=run.name,
                      next_step=run.transition.next_step if run.transition else None,
                      forced=run.transition.forced if run.transition else None,
                      llm_calls=run.llm_calls, total_tokens=run.tokens,
                      summary=run.transition.summary if run.transition else None,
                      replayed=run.replayed_from is not None, conversation=_conversation(run, run.start))
            for seq, run in tl.runs.items() if run.start is not None}


def _without_clock(user: str) -> str:
    clock = clock_block(user)
    return user[len(clock):] if clock else user


def _run_costs(frames: Frames, job_id: int) -> dict[int, float]:
    """US dollars per movement run, priced call by call as ``frames.usage()`` prices them; NaN when any call of
    the run has no price (a partial sum would pass for a total)."""
    usage = frames.usage(job_id)
    if usage.empty:
        return {}
    sums = usage.groupby("seq")["cost_usd"].agg(lambda s: float(s.sum(skipna=False)))
    return {int(seq): float(cost) for seq, cost in zip(sums.index, sums.to_numpy(), strict=True)}


class Comparison:
    """Jobs ``a`` and ``b`` side by side, aligned by movement run (``ws.compare(a, b)``).

    ``frame``: one row per movement-run position with each side's movement, next step, calls, tokens, cost,
    summary and whether it re-served the run, and whether the two runs are ``identical``; ``diverged`` marks
    the first position where they are not (``first_divergence``).  ``files()``: how their ``output/``
    folders differ.  In a notebook it shows the two runs side by side.
    """

    def __init__(self, source: JobSource, frames: Frames, a: int, b: int) -> None:
        self._source = source
        self._frames = frames
        self.a = a
        self.b = b
        source.store.job(a)  # a StoreError naming the job when there is none
        source.store.job(b)

    # -- the movement runs ----------------------------------------------------------------------------------
    @property
    def frame(self) -> pd.DataFrame:
        """One row per movement-run position (``seq`` 1 … the longer job's last run).

        Per side (``_a``, ``_b``): ``movement``, ``next_step``, ``forced``, ``llm_calls``, ``total_tokens``
        (the tokens spent: 0 for a re-served run; both count a compaction's summarisation call), ``cost_usd`` (US dollars, as ``frames.usage()`` prices the
        calls), ``summary`` and ``replayed`` (the run was re-served from another job's record); NA where that
        side has no such run.  ``identical``: both ran the same movement with the same conversation;
        ``diverged``: True on the first position that is not identical, only there.
        """
        return self._frame()

    @property
    def first_divergence(self) -> int | None:
        """The first movement-run position where the two runs are not identical; None when none is."""
        frame = self.frame
        hit = frame.loc[frame["diverged"], "seq"]
        return int(hit.iloc[0]) if len(hit) else None

    def _frame(self) -> pd.DataFrame:
        import pandas as pd

        runs = {"a": _runs(fold(self._source.events(self.a))), "b": _runs(fold(self._source.events(self.b)))}
        costs = {"a": _run_costs(self._frames, self.a), "b": _run_costs(self._frames, self.b)}
        last = max([0, *runs["a"], *runs["b"]])
        seqs = list(range(1, last + 1))
        columns: dict[str, pd.Series] = {"seq": pd.Series(seqs, dtype="int64")}
        for side in ("a", "b"):
            mine = runs[side]
            for name in RUN_FIELDS:
                values: list[Any] = []
                for seq in seqs:
                    run = mine.get(seq)
                    if run is None:
                        values.append(None)
                    elif name == "cost_usd":
                        values.append(costs[side].get(seq, 0.0))  # a run without calls cost nothing
                    else:
                        values.append(getattr(run, name))
                dtype = _RUN_DTYPES[name]
                col = pd.Series(values, dtype=object)
                columns[f"{name}_{side}"] = (pd.to_numeric(col).astype(dtype) if dtype == "float64"
                                             else col.astype(dtype))
        identical = [seq in runs["a"] and seq in runs["b"]
                     and runs["a"][seq].conversation == runs["b"][seq].conversation for seq in seqs]
        first = next((i for i, same in enumerate(identical) if not same), None)
        columns["identical"] = pd.Series(identical, dtype=bool)
        columns["diverged"] = pd.Series([i == first for i in range(len(seqs))], dtype=bool)
        return pd.DataFrame(columns, index=pd.RangeIndex(len(seqs)))

    # -- output/ ----------------------------------------------------------------------------------------------
    def files(self, *, unchanged: bool = False) -> pd.DataFrame:
        """How the two work directories' ``output/`` differ, one row per file, sorted by path.

        ``path`` is relative to ``output/``; ``change`` is ``added`` (only in b), ``removed`` (only in a) or
        ``changed`` (``same`` too with ``unchanged=True``); ``size_a``/``size_b`` in bytes (NA where absent,
        and for a symbolic link); ``diff`` a unified diff (``a/output/…`` → ``b/output/…``, ``/dev/null`` for
        a missing side) when both sides are UTF-8 text, else None (binary, a link, a special file, or over
        ``MAX_DIFF_BYTES``).  Symbolic links are never followed: a link is compared by where it points.
        """
        import pandas as pd

        left = self._output_tree(self.a)
        right = self._output_tree(self.b)
        rows: list[dict[str, Any]] = []
        for path in sorted(left.keys() | right.keys()):
            x, y = left.get(path), right.get(path)
            if x is None:
                change = "added"
            elif y is None:
                change = "removed"
            elif x.same_as(y):
                if not unchanged:
                    continue
                change = "same"
            else:
                change = "changed"
            rows.append({"path": path, "change": change, "size_a": x.size if x else None,
                         "size_b": y.size if y else None,
                         "diff": None if change == "same" else _diff(path, x, y)})
        return pd.DataFrame({
            "path": pd.Series([r["path"] for r in rows], dtype="string"),
            "change": pd.Series([r["change"] for r in rows], dtype=pd.CategoricalDtype(list(CHANGES))),
            "size_a": pd.Series([r["size_a"] for r in rows], dtype="Int64"),
            "size_b": pd.Series([r["size_b"] for r in rows], dtype="Int64"),
            # object, so that a binary file's diff is None (pandas would read text with gaps as str with NaN)
            "diff": pd.Series([r["diff"] for r in rows], dtype=object),
        }, columns=list(FILE_COLUMNS))

    def _output_tree(self, job_id: int) -> dict[str, _Entry]:
        store = self._source.store
        if not store.keeps_files:
            return _tree(Path(store.job(job_id).workdir))
        # where files live in the store (docs/stores.md#files) the job may have run on another machine: its output/ as the
        # store holds it, copied aside (_tree keeps what it compares in memory)
        import tempfile

        with tempfile.TemporaryDirectory(prefix="agentnb-compare-") as tmp:
            pull_files(store, job_id, Path(tmp), tmp, under="output")
            return _tree(Path(tmp))

    # -- display ----------------------------------------------------------------------------------------------
    def fork_note(self) -> ForkNote | None:
        """How the two jobs are related, when one was made from the other: a fork (at which run) or a replay."""
        for child, parent in ((self.b, self.a), (self.a, self.b)):
            row = self._source.store.job(child)
            if row.forked_from is not None and row.forked_from[0] == parent:
                return ForkNote(child=child, parent=parent, at=row.forked_from[1])
            if row.model == f"replay:{parent}":
                return ForkNote(child=child, parent=parent, at=None)
        return None

    def __repr__(self) -> str:
        frame = self.frame
        first = frame.loc[frame["diverged"], "seq"]
        same = int(frame["identical"].sum())
        where = f"diverge at run {int(first.iloc[0])}" if len(first) else "identical"
        return f"<Comparison of job {self.a} and job {self.b}: {len(frame)} run position(s), {same} identical, {where}>"

    def _repr_html_(self) -> str:
        return self.html()

    def html(self, *, max_chars: int | None = DEFAULT_MAX_CHARS, max_calls: int | None = DEFAULT_MAX_CALLS,
             max_bytes: int | None = DEFAULT_MAX_BYTES, full: bool = False) -> str:
        """The two runs side by side, bounded as the job view is (``None`` lifts one bound, ``full=True`` all;
        see :func:`agentnb.views.compare_html.comparison_html`)."""
        return comparison_html(self._source, self.a, self.b, self._frame(), note=self.fork_note(),
                               max_chars=max_chars, max_calls=max_calls, max_bytes=max_bytes, full=full)


# -- output/ trees --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Entry:
    """One entry of an ``output/`` tree: a regular file (its bytes), a symbolic link (its target) or another
    kind of file (a FIFO, a socket…, never opened)."""

    kind: str  # "file" | "link" | "special"
    size: int | None
    data: bytes | None = None  # a file's bytes, up to MAX_DIFF_BYTES
    digest: str | None = None  # a larger file's SHA-256
    target: str | None = None  # a link's target, or a special file's kind

    def same_as(self, other: _Entry) -> bool:
        return self == other


def _tree(workdir: Path) -> dict[str, _Entry]:
    """The entries of ``workdir/output`` by their path relative to it; no link is followed, so nothing outside
    the work directory is read (a linked ``output/`` itself reads as empty)."""
    try:
        top = unlinked_path(workdir, "output")
    except ToolError:
        return {}
    if not top.is_dir():
        return {}
    out: dict[str, _Entry] = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        dirnames.sort()
        here = Path(dirpath)
        # a link to a folder is listed among the folders, and not walked into: it is an entry of its own
        names = [*filenames, *(d for d in dirnames if (here / d).is_symlink())]
        for name in sorted(names):
            path = here / name
            rel = path.relative_to(top).as_posix()
            out[rel] = _entry(path, rel)
    return out


def _entry(path: Path, rel: str) -> _Entry:
    try:
        st = os.lstat(path)
    except OSError:
        return _Entry("special", None, target="gone")
    if stat.S_ISLNK(st.st_mode):
        try:
            return _Entry("link", None, target=os.readlink(path))
        except OSError:
            return _Entry("link", None, target="?")
    if not stat.S_ISREG(st.st_mode):
        return _Entry("special", None, target=special_kind(st.st_mode))
    try:
        fd = open_regular(path, rel)  # O_NOFOLLOW, O_NONBLOCK: a file swapped for a link or a FIFO is not read
    except ToolError:
        return _Entry("special", st.st_size, target="unreadable")
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(MAX_DIFF_BYTES + 1)
        if len(data) <= MAX_DIFF_BYTES:
            return _Entry("file", len(data), data=data)
        # too large to diff: compared by digest, without holding the whole file
        digest = hashlib.sha256(data)
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
        return _Entry("file", fh.tell(), digest=digest.hexdigest())


def _text(entry: _Entry | None) -> list[str] | None:
    """A file's lines for a diff (git's marker after a last line without a newline); None when not UTF-8
    text."""
    if entry is None:
        return []
    if entry.kind != "file" or entry.data is None or b"\0" in entry.data:
        return None
    try:
        text = entry.data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1] + "\n\\ No newline at end of file\n")
    return lines


def _diff(path: str, a: _Entry | None, b: _Entry | None) -> str | None:
    left, right = _text(a), _text(b)
    if left is None or right is None:
        return None
    before = f"a/output/{path}" if a is not None else "/dev/null"
    after = f"b/output/{path}" if b is not None else "/dev/null"
    return "".join(difflib.unified_diff(left, right, fromfile=before, tofile=after))
