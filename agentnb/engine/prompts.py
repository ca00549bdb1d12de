"""The prompts: their fixed texts in English and Japanese (the piece's ``language``) and their assembly.

A movement's user prompt is the job's enriched instruction (:func:`build_enriched_instruction`, built
once per activation: date and time, the last comments, the input/output listing, the task), then what
earlier movements carried over — lessons, checklists, a verifier's feedback, the results of subtasks,
the git excerpt after a verifying movement — then the step's own instruction and how to finish it
(:func:`user_prompt`).  Older comments, earlier movements' conversations, logs and file contents are
deliberately left out.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..events import Lesson, Subtask, Transition
from ..store import reads
from ..store.records import CommentRecord
from ..tools.base import ToolError, open_regular, unlinked_path
from .git_context import git_excerpt
from .pieces import Movement, Piece

if TYPE_CHECKING:
    from ..store.base import Store
    from ..store.records import JobRecord

__all__ = [
    "MAX_COMMENTS",
    "MAX_COMMENT_CHARS",
    "MAX_LESSON_CHARS",
    "MAX_LISTED_FILES",
    "TEXTS",
    "activation_instruction",
    "build_enriched_instruction",
    "clock_block",
    "finish_block",
    "text",
    "transition_schema",
    "user_prompt",
]

MAX_COMMENTS = 5
MAX_COMMENT_CHARS = 500
MAX_LISTED_FILES = 50
MAX_LESSON_CHARS = 2000

TEXTS: dict[str, dict[str, str]] = {
    "en": {
        "time": "## Current date and time",
        "comments": "## Conversation so far (last {shown} of {total} comments)",
        "cut": "… [cut: {shown} of {total} characters shown]",
        "workspace": "## Workspace files",
        "empty": "(empty)",
        "more_files": "… and {n} more",
        "task": "## Task",
        "lessons": "## Lessons from previous steps",
        "checklists": "## Checklists",
        "feedback": "## Feedback from verification (newest last)",
        "feedback_item": "### Feedback {n} from `{source}`",
        "subtasks": "## Results of subtasks",
        "git": "## Changes in the work directory (git)",
        "step": "## Current step: {name}",
        "finish": "## How to finish this step",
        "finish_intro": "When this step is done, call the `transition` tool with `next_step` set to one of:",
        "finish_abort": "- `ABORT`: the task cannot be done at all",
        "finish_notes": "Give a short `summary`, and `lessons` worth keeping for later steps.",
        "reminder": "You replied without calling a tool. Continue the work with the tools, or finish this step by calling `transition` with `next_step` one of: {steps}.",
        "wrap_up": "The context window is {pct} full ({tokens:,} of {window:,} tokens). Wrap up your work now: save what matters, then call `transition` with a summary.",
        "subtask_line": "- job {id} ({status}): {instruction}\n  summary: {summary}",
        "subtask_error": "  error: {error}",
        "loop": "The cycle {cycle} has repeated {count} times. Summaries of the runs in the loop, oldest first:",
        "loop_run": "- run {seq} ({name}): {summary}",
        "checklist_head": "### {name} ({done}/{total} done)",
        "compact_request": "The context window is {pct} full. Summarise the conversation so far so that the work can go on from the summary alone: the task, what has been done and found (files, facts, decisions), what is still open and the next step. Reply with the summary only; do not call tools.",
        "compact_summary": "[Summary of the earlier conversation — agentnb compacted it to free the context window (compaction {n})]\n\n{summary}",
    },
    "ja": {
        "time": "## 現在日時",
        "comments": "## これまでのやり取り (直近 {shown} 件 / 全 {total} 件)",
        "cut": "… [切り詰め: {total} 文字中 {shown} 文字を表示]",
        "workspace": "## ワークスペースの状況",
        "empty": "(空)",
        "more_files": "… ほか {n} 件",
        "task": "## タスク",
        "lessons": "## 前のステップで得た教訓",
        "checklists": "## チェックリスト",
        "feedback": "## 検証からのフィードバック (新しいものが最後)",
        "feedback_item": "### `{source}` からのフィードバック {n}",
        "subtasks": "## サブタスクの結果",
        "git": "## 作業ディレクトリの変更 (git)",
        "step": "## 現在のステップ: {name}",
        "finish": "## このステップの終え方",
        "finish_intro": "このステップが終わったら、`transition` ツールを `next_step` に次のいずれかを指定して呼んでください:",
        "finish_abort": "- `ABORT`: タスクがどうしても実行できない",
        "finish_notes": "短い `summary` と、後のステップに残すべき `lessons` を添えてください。",
        "reminder": "ツールを呼ばずに応答しました。ツールで作業を続けるか、`transition` を呼んでこのステップを終えてください (next_step: {steps})。",
        "wrap_up": "コンテキストが {pct} まで埋まっています ({window:,} トークン中 {tokens:,})。作業をまとめて、`transition` を summary 付きで呼んでください。",
        "subtask_line": "- ジョブ {id} ({status}): {instruction}\n  要約: {summary}",
        "subtask_error": "  エラー: {error}",
        "loop": "サイクル {cycle} が {count} 回繰り返されました。ループ内の各実行の要約 (古い順):",
        "loop_run": "- 実行 {seq} ({name}): {summary}",
        "checklist_head": "### {name} ({total} 件中 {done} 件完了)",
        "compact_request": "コンテキストが {pct} まで埋まっています。この要約だけから作業を続けられるように、ここまでの会話を要約してください: タスク、済んだことと分かったこと (ファイル、事実、決定)、残っていること、次の一歩。要約だけを返し、ツールは呼ばないでください。",
        "compact_summary": "[これまでの会話の要約 — コンテキストを空けるため agentnb が圧縮しました (圧縮 {n} 回目)]\n\n{summary}",
    },
}


def text(language: str, key: str, **values: object) -> str:
    template = TEXTS.get(language, TEXTS["en"])[key]
    return template.format(**values) if values else template


# -- the enriched instruction: the opening of every movement's user prompt ---------------------------------

def build_enriched_instruction(
    *,
    instruction: str,
    comments: Sequence[CommentRecord],
    total_comments: int,
    workdir: Path,
    language: str = "en",
    now: datetime | None = None,
    clock: str | None = None,
) -> str:
    """The opening of every movement's user prompt for one activation of a job.

    ``clock``: the date-and-time block to use instead of now's (a replay or fork takes its original's, so
    that its prompts are the original's: :func:`clock_block`)."""
    blocks = [clock or _now_block(language, now)]
    if comments:
        blocks.append(_comment_block(comments, total_comments, language))
    files = [text(language, "workspace")]
    root = os.path.realpath(workdir)
    files += _listing(workdir / "input", "input", language, root)
    files += _listing(workdir / "output", "output", language, root)
    blocks.append("\n".join(files))
    blocks.append(f"{text(language, 'task')}\n{instruction}")
    return "\n\n".join(blocks)


def activation_instruction(store: Store, job: JobRecord, *, language: str, clock: str | None = None,
                           workdir: Path | None = None) -> str:
    """The enriched instruction of job ``job`` (its row) for an activation starting now: its last comments,
    its work directory's listing (``workdir``: where it is on this machine, else the row's) and, unless
    ``clock`` is given, the current date and time."""
    job_id = job.id
    return build_enriched_instruction(
        instruction=job.instruction, comments=reads.comments(store, job_id, last=MAX_COMMENTS),
        total_comments=reads.count_comments(store, job_id), workdir=workdir or Path(job.workdir), language=language,
        clock=clock,
    )


def _now_block(language: str, now: datetime | None = None) -> str:
    now = now or datetime.now().astimezone()
    tz = now.tzname() or "UTC"
    return f"{text(language, 'time')}\n{now.strftime('%Y-%m-%d %H:%M')} ({now.strftime('%A')}, {tz})"


def clock_block(user_prompt: str) -> str | None:
    """The date-and-time block a movement's user prompt opens with, or None when it opens otherwise."""
    head, _, _ = user_prompt.partition("\n\n")
    if any(head.startswith(t["time"] + "\n") for t in TEXTS.values()) and head.count("\n") == 1:
        return head
    return None


def _comment_block(comments: Sequence[CommentRecord], total: int, language: str) -> str:
    lines = [text(language, "comments", shown=len(comments), total=total)]
    for c in comments:
        body = c.body
        if len(body) > MAX_COMMENT_CHARS:
            body = body[:MAX_COMMENT_CHARS] + " " + text(language, "cut", shown=MAX_COMMENT_CHARS, total=len(body))
        when = datetime.fromtimestamp(c.ts, tz=timezone.utc).astimezone().strftime("%Y-%m-%d %H:%M")
        lines.append(f"- [{c.author}, {when}] {body}")
    return "\n".join(lines)


def _listing(folder: Path, label: str, language: str, root: str) -> list[str]:
    """``folder``'s files, names and sizes; ``root``: the work directory, resolved."""
    lines = [f"{label}/"]
    entries: list[tuple[str, int]] = []
    # what the tools cannot reach is not listed either: a linked input/ (or a link in it) that leads out of the work
    # directory would show the names of outside files.  Only links are resolved: os.walk enters no linked folder,
    # so a file that is not a link, in a folder that is not one, is inside.
    if folder.is_dir() and (not folder.is_symlink() or _inside(folder, root)):
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames.sort()
            for name in sorted(filenames):
                p = Path(dirpath) / name
                try:
                    st = p.lstat()
                    if stat.S_ISLNK(st.st_mode):
                        if not _inside(p, root):
                            continue
                        st = p.stat()
                except OSError:
                    continue
                entries.append((p.relative_to(folder).as_posix(), st.st_size))
    if not entries:
        lines.append(f"  {text(language, 'empty')}")
    for rel, size in entries[:MAX_LISTED_FILES]:
        lines.append(f"  - {rel} ({size:,} bytes)")
    if len(entries) > MAX_LISTED_FILES:
        lines.append("  " + text(language, "more_files", n=len(entries) - MAX_LISTED_FILES))
    return lines


def _inside(p: Path, root: str) -> bool:
    return os.path.realpath(p).startswith(root + os.sep)


# -- a movement's user prompt ---------------------------------------------------------------------------

def user_prompt(store: Store, job: JobRecord, piece: Piece, movement: Movement, *, logs_dir: Path,
                workdir: Path) -> str:
    """The first user message of ``movement``: the enriched instruction, what earlier movements of job
    ``job`` carried over, then the step's instruction and how to finish it."""
    job_id = job.id
    lang = piece.language
    parts = [job.enriched or ""]
    lessons = _lessons_block(store.events(job_id, kinds=["lesson"]))
    if lessons:
        parts.append(f"{text(lang, 'lessons')}\n{lessons}")
    checklists = _checklists_block(logs_dir, lang)
    if checklists:
        parts.append(f"{text(lang, 'checklists')}\n{checklists}")
    transitions = [ev for ev in store.events(job_id, kinds=["transition"]) if isinstance(ev, Transition)]
    feedback = _feedback_block(transitions, piece, movement)
    if feedback:
        parts.append(f"{text(lang, 'feedback')}\n\n{feedback}")
    last = transitions[-1] if transitions else None
    if last is not None and last.next_step == "WAIT_SUBTASKS" and last.subtasks:
        parts.append(f"{text(lang, 'subtasks')}\n{_subtasks_block(store, last.subtasks, lang)}")
    if last is not None and last.movement and _is_verify(piece, last.movement):
        git = git_excerpt(workdir)
        if git:
            parts.append(f"{text(lang, 'git')}\n{git}")
    parts.append(f"{text(lang, 'step', name=movement.name)}\n{movement.instruction.strip()}")
    parts.append(finish_block(movement, lang))
    return "\n\n".join(p for p in parts if p)


def _lessons_block(events: Sequence[object]) -> str:
    """The lessons so far, newest kept, oldest dropped, within :data:`MAX_LESSON_CHARS`."""
    items = [f"- [{ev.movement}] {ev.lessons.strip()}" for ev in events if isinstance(ev, Lesson)]
    kept: list[str] = []
    size = 0
    for item in reversed(items):
        if size + len(item) + 1 > MAX_LESSON_CHARS:
            if not kept:
                kept.append(item[: MAX_LESSON_CHARS - 1] + "…")
            break
        kept.append(item)
        size += len(item) + 1
    return "\n".join(reversed(kept))


def _checklists_block(logs_dir: Path, language: str) -> str:
    try:
        folder = unlinked_path(logs_dir.parent, logs_dir.name, "checklists")
    except ToolError:
        return ""  # a link planted in logs/ must not bring outside files into the prompt
    if not folder.is_dir():
        return ""
    out = []
    for path in sorted(folder.glob("*.json")):
        if path.is_symlink():
            continue
        try:
            # a FIFO named x.json (Bash can make one) would block the worker on every prompt
            with open(open_regular(path, f"logs/checklists/{path.name}"), encoding="utf-8") as fh:
                data = json.loads(fh.read())
        except (OSError, ValueError, ToolError):
            continue
        # the default work directory holds logs/, so the model may have written these files itself
        raw = data.get("items") if isinstance(data, dict) else None
        items = [i for i in raw if isinstance(i, dict)] if isinstance(raw, list) else []
        done = sum(1 for i in items if i.get("done"))
        out.append(text(language, "checklist_head", name=path.stem, done=done, total=len(items)))
        out += [f"- [{'x' if i.get('done') else ' '}] {i.get('text', '')}" for i in items]
    return "\n".join(out)


def _feedback_block(transitions: Sequence[Transition], piece: Piece, movement: Movement) -> str:
    """The feedback of every verifying movement that sent the job back to ``movement``, oldest first."""
    items = [(ev.movement, ev.feedback) for ev in transitions
             if ev.next_step == movement.name and ev.feedback and _is_verify(piece, ev.movement, target=movement.name)]
    return "\n\n".join(
        f"{text(piece.language, 'feedback_item', n=n, source=source)}\n{feedback.strip()}"
        for n, (source, feedback) in enumerate(items, start=1)
    )


def _is_verify(piece: Piece, name: str, target: str | None = None) -> bool:
    try:
        mv = piece.movement(name)
    except KeyError:
        return False
    return mv.verify is not None and (target is None or mv.verify == target)


def _subtasks_block(store: Store, subtasks: Sequence[Subtask], language: str) -> str:
    """One entry per child: its status, its last summary and, when it failed or was aborted, why."""
    lines = []
    for sub in subtasks:
        child = store.job(sub.job_id)
        summary = ""
        for ev in reversed(store.events(sub.job_id, kinds=["transition"])):
            if isinstance(ev, Transition):
                summary = ev.summary
                break
        lines.append(text(language, "subtask_line", id=sub.job_id, status=child.status.value,
                          instruction=sub.instruction, summary=summary or "-"))
        # an abort's reason is usually its summary; a failure's message never is
        if child.error and child.error != summary:
            lines.append(text(language, "subtask_error", error=child.error))
    return "\n".join(lines)


def finish_block(movement: Movement, language: str) -> str:
    """The prompt's "how to finish" block: one line per value of ``movement.next_steps``, no more, no less."""
    lines = [text(language, "finish"), text(language, "finish_intro")]
    for rule in movement.rules:
        lines.append(f"- `{rule.next}`" + (f": {rule.condition}" if rule.condition else ""))
    if "ABORT" not in {r.next for r in movement.rules}:
        lines.append(text(language, "finish_abort"))
    lines.append(text(language, "finish_notes"))
    return "\n".join(lines)


def transition_schema(movement: Movement) -> dict[str, Any]:
    steps = list(movement.next_steps)
    return {
        "type": "function",
        "function": {
            "name": "transition",
            "description": (
                "End this step and choose what happens next. Always give a short summary of what was done; "
                "lessons are notes worth passing on to later steps."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    # the same list, in the same order, as the prompt's "how to finish" block and the reminder
                    "next_step": {"type": "string", "enum": steps,
                                  "description": f"One of: {', '.join(steps)} (ABORT: the task cannot be done at all)."},
                    "summary": {"type": "string", "description": "What this step did."},
                    "lessons": {"type": "string", "description": "What later steps should know."},
                    "question": {"type": "string", "description": "With ASK: the question for the user."},
                    "feedback": {"type": "string", "description": "When verifying: what must be fixed, for the step that did the work."},
                    "subtasks": {
                        "type": "array",
                        "description": "With WAIT_SUBTASKS: the subtasks to run as child jobs.",
                        "items": {
                            "type": "object",
                            "properties": {"instruction": {"type": "string"}, "piece": {"type": "string"},
                                           "model": {"type": "string"}},
                            "required": ["instruction"],
                        },
                    },
                    "resume": {"type": "string", "description": "With WAIT_SUBTASKS: the movement to resume at when the subtasks end."},
                },
                "required": ["next_step"],
            },
        },
    }
