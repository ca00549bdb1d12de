"""A running job followed in a terminal (``agentnb run --follow``, docs/cli.md#following-a-run): each movement run's
header, the model's text as it streams, each tool call as it forms (its name at once, its arguments growing),
each tool's result in one short line.

It follows the job through the in-process subscription (:meth:`agentnb.execution.Execution.subscribe`): the
``delta`` notices of the running call and the events each commit publishes, of the job and of every job this
process runs meanwhile (the command runs nothing else but the job's subtasks, which it labels).  The subscriber
only appends what arrived to a list, in the job's thread; a thread of its own writes it out, at most
:data:`INTERVAL` apart, in one write each time, so that a slow terminal or pipe never holds the job up.

Only appended text is written, never a cursor movement, so a pipe or a file gets plain lines; on a terminal the
headers are bold and the results dim (not with ``NO_COLOR`` set or ``TERM=dumb``).

No secret is printed.  The store masks secrets in what it keeps (``_secrets.scrub`` on every event) and the
events printed here come from it; streamed fragments are not stored, so the same masking is applied to them
here, on the text so far (``_secrets.shown_so_far``'s rule): the end of it that could still grow into a secret
(the start of a secret value, an ``sk-…`` key or a ``Bearer`` token not yet ended) is held back until the next
fragment settles it or the call is recorded.  When the call is recorded, what its ``llm_response`` holds (masked
by the store) is printed in place of what is still held back, so the printed text is the recorded one.  Parallel
tool calls may stream interleaved: each part is written on its line until the next part begins, and what it
streams after that is written, on a line of its own, when the call is recorded.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from . import live
from ._secrets import mask_streamed, scrub, settled, streamed_values
from .live import Notice
from .views.timeline import tool_label

if TYPE_CHECKING:
    from .execution import Execution

__all__ = ["INTERVAL", "Follower"]

INTERVAL = 0.05  # seconds between two writes: at most twenty a second
_RESULT_CHARS = 100  # of a tool result's first line
_CLOSED = -1  # no part's line is open (a part is None, the text, or a tool call's index ≥ 0)

@dataclass
class _Part:
    """The text of a call, or one of its tool calls, as streamed so far, and how much of it is printed."""

    name: str | None  # the tool's name ("" until it comes); None for the text
    raw: list[str] = field(default_factory=list)
    printed: str = ""  # the masked text written so far
    left: bool = False  # another part was written after it: the rest of it is written when the call is recorded

    @property
    def json_text(self) -> bool:
        return self.name is not None


class Follower:
    """Write what the jobs run in this process do to ``out`` while the ``with`` block runs them.

    ``job_id`` is the job the command runs: its movement runs' headers are not labelled with it, those of any
    other job (a subtask) are.  ``style``: bold headers and dim results (a terminal's)."""

    def __init__(self, execution: Execution, out: TextIO, *, job_id: int | None = None, style: bool = False,
                 interval: float = INTERVAL) -> None:
        self.execution = execution
        self.out = out
        self.job_id = job_id
        self.interval = interval
        self._bold, self._dim, self._plain = ("\x1b[1m", "\x1b[2m", "\x1b[0m") if style else ("", "", "")
        self._items: list[live.Item] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._broken = False  # the output went away (a closed pipe): nothing more is written
        self._wrote = False
        self._sub: live.Subscription | None = None
        self._thread: threading.Thread | None = None
        # the printing thread's state
        self._at_line_start = True
        self._movement: tuple[int, int | None] | None = None  # (job, movement_seq) of the last header
        self._call: tuple[int, int | None, int | None] | None = None
        self._parts: dict[int | None, _Part] = {}  # None: the text; else the tool call's index
        self._open: int | None = _CLOSED  # the part whose line is being written

    # -- the subscription and the writing thread --------------------------------------------------------------
    def __enter__(self) -> Follower:
        self._sub = self.execution.subscribe(None, self._arrived)
        self._thread = threading.Thread(target=self._loop, name="agentnb-follow", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sub is not None:
            self._sub.close()
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._thread is None or not self._thread.is_alive():
            out = [self._render(self._take())]
            self._newline(out)
            if self._wrote or any(out):  # a blank line between what the run printed and the job's own lines
                out.append("\n")
            self._write("".join(out))

    def _arrived(self, item: live.Item) -> None:
        # in the job's thread: note it and let the writing thread write
        with self._lock:
            self._items.append(item)
        self._wake.set()

    def _take(self) -> list[live.Item]:
        with self._lock:
            items, self._items = self._items, []
        return items

    def _loop(self) -> None:
        last = 0.0
        while not self._closing:
            self._wake.wait(0.5)
            if self._closing:
                return  # __exit__ writes the rest
            self._wake.clear()
            time.sleep(max(0.0, last + self.interval - time.monotonic()))
            last = time.monotonic()
            self._write(self._render(self._take()))

    def _write(self, text: str) -> None:
        if not text or self._broken:
            return
        self._wrote = True
        try:
            self.out.write(text)
            self.out.flush()
        except (OSError, ValueError):
            self._broken = True  # a reader that went away must not stop the job

    # -- rendering (the writing thread only) -------------------------------------------------------------------
    def _render(self, items: list[live.Item]) -> str:
        out: list[str] = []
        for item in items:
            if isinstance(item, Notice):
                if item.what == "call_started":
                    self._cut_off(out)
                    self._header(out, item.job_id, item.movement_seq)
                    self._call = (item.job_id, item.movement_seq, item.iteration)
                elif item.what == "delta":
                    self._delta(out, item)
                continue
            self._event(out, item)
        self._advance(out, self._open)
        return "".join(out)

    def _emit(self, out: list[str], text: str) -> None:
        if text:
            out.append(text)
            self._at_line_start = text.endswith("\n")

    def _newline(self, out: list[str]) -> None:
        if not self._at_line_start:
            self._emit(out, "\n")
        self._open = _CLOSED

    def _header(self, out: list[str], job_id: int, seq: int | None, name: str | None = None) -> None:
        """The header of movement run ``seq`` of ``job_id``, unless it is the one printed last."""
        if (job_id, seq) == self._movement or seq is None:
            return
        self._movement = (job_id, seq)
        if name is None:  # a run resumed in its middle: no movement_start is published for it
            name = self._movement_name(job_id, seq)
        self._newline(out)
        job = "" if job_id == self.job_id else f"job {job_id} · "
        self._emit(out, f"{self._bold}── {job}{seq}. {name} ──{self._plain}\n")

    def _movement_name(self, job_id: int, seq: int) -> str:
        try:
            starts = self.execution.store.events(job_id, kinds=["movement_start"], movement_seq=seq)
        except Exception:  # a store that does not answer: the header without the name
            return "movement"
        return str(getattr(starts[-1], "movement", "movement")) if starts else "movement"

    def _delta(self, out: list[str], item: Notice) -> None:
        key = (item.job_id, item.movement_seq, item.iteration)
        if key != self._call:
            self._cut_off(out)
            self._header(out, item.job_id, item.movement_seq)
            self._call = key
        delta = item.detail["delta"]
        if delta.restart:  # the stream broke off and the call is asked again: what it printed is void
            if self._parts:
                if not self._at_line_start:
                    self._emit(out, " …")
                self._newline(out)
                self._emit(out, "(the answer broke off; asked again)\n")
            self._parts, self._open = {}, _CLOSED
            return
        index = delta.tool_index
        part = self._parts.get(index)
        if part is None:
            part = self._parts[index] = _Part(name=None if index is None else "")
        if index is not None and delta.tool_name:
            part.name = delta.tool_name  # the whole name so far: it may come after the call opens, or in pieces
        fragment = delta.arguments if index is not None else delta.text
        part.raw.append(fragment)
        # a tool call is named when its arguments begin (its name is whole by then); a part the follower left
        # waits for the call's record: parallel calls may stream interleaved, and one line is written at a time
        if index == self._open or part.left or not fragment:
            return
        left = self._parts.get(self._open) if self._open != _CLOSED else None
        if left is not None:
            # written as far as it is settled, never further: what it holds back may still grow into a secret
            self._advance(out, self._open)
            left.left = True
        self._switch(out, index)

    def _switch(self, out: list[str], index: int | None) -> None:
        """Go on writing part ``index`` on a line of its own (a tool call's starts with its name)."""
        if index == self._open:
            return
        self._newline(out)
        part = self._parts[index]
        if part.name is not None:
            again = " …" if part.printed else ""
            self._emit(out, f"→ {scrub(part.name) or '?'}{again} ")  # a name is the model's text too
        self._open = index

    def _advance(self, out: list[str], index: int | None) -> None:
        """Write what of part ``index`` is settled and not written yet."""
        part = self._parts.get(index)
        if part is None:
            return
        text = "".join(part.raw)
        values = streamed_values(part.json_text)
        clean = mask_streamed(text[:settled(text, values)], values, part.json_text)
        if clean.startswith(part.printed):  # always, but for a secret masked otherwise once the text grew
            self._emit(out, clean[len(part.printed):])
            part.printed = clean

    def _finish(self, out: list[str], index: int | None, final: str) -> None:
        """Part ``index`` ends as ``final`` (masked): write what of it is not written yet."""
        part = self._parts.setdefault(index, _Part(name=None))
        rest = final[len(part.printed):] if final.startswith(part.printed) else ""
        if rest or (not part.printed and part.name is not None):  # a tool call is named even without arguments
            self._switch(out, index)
            self._emit(out, rest)
        part.printed = final

    def _cut_off(self, out: list[str]) -> None:
        """The call streaming so far was not recorded (cut off, failed): what is held back of it is dropped."""
        if self._parts:
            if not self._at_line_start:
                self._emit(out, " …")
            self._newline(out)
        self._parts, self._call, self._open = {}, None, _CLOSED

    def _event(self, out: list[str], ev: Any) -> None:
        kind = ev.kind
        if kind == "movement_start":
            self._cut_off(out)
            self._header(out, ev.job_id, ev.movement_seq, ev.movement)
        elif kind == "llm_response":
            self._header(out, ev.job_id, ev.movement_seq)
            self._recorded(out, ev)
        elif kind == "tool_result":
            self._newline(out)
            first, *rest = (ev.content or "").strip().splitlines() or [""]
            more = " …" if rest or len(first) > _RESULT_CHARS else ""
            lines = f" ({len(rest) + 1} lines)" if rest else ""
            error = " (error)" if ev.is_error else ""
            self._emit(out, f"{self._dim}  ← {tool_label(ev.tool, ev.server)}{error}: {first[:_RESULT_CHARS]}{more}{lines}{self._plain}\n")
        elif kind == "error":
            self._cut_off(out)
            self._newline(out)
            where = f"{ev.where}: " if ev.where else ""
            self._emit(out, f"  ! {where}{' '.join(str(ev.message).split())}\n")

    def _recorded(self, out: list[str], ev: Any) -> None:
        """The call is recorded: its text and tool calls as the store keeps them, the streamed ones completed."""
        if (ev.job_id, ev.movement_seq, ev.iteration) != self._call:
            self._cut_off(out)
        finals: dict[int | None, str] = {None: ev.content or ""}
        for index, call in enumerate(ev.tool_calls):
            part = self._parts.get(index)
            if part is None:
                self._parts[index] = _Part(name=call.name)
                finals[index] = call.raw_arguments or json.dumps(call.arguments, ensure_ascii=False)
            else:  # as it streamed (the recorded arguments are parsed and may be written otherwise)
                finals[index] = mask_streamed("".join(part.raw), streamed_values(True), True)
        # the part whose line is open ends on it first; then the others, in order (a part left earlier: its rest)
        for key in sorted(finals, key=lambda i: (i != self._open, -1 if i is None else i)):
            self._finish(out, key, finals[key])
        self._newline(out)
        self._parts, self._call = {}, None
