"""Headings and fixed texts of the prompts, in English and Japanese (the piece's ``language``)."""

from __future__ import annotations

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
        "checklist_head": "### {name} ({done}/{total} done)",
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
        "checklist_head": "### {name} ({total} 件中 {done} 件完了)",
    },
}


def text(language: str, key: str, **values: object) -> str:
    template = TEXTS.get(language, TEXTS["en"])[key]
    return template.format(**values) if values else template
