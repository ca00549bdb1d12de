"""Budgeted tool output: Read in pieces through the hinted offsets, and cut Bash/Grep/Glob output.

The property tests follow ONLY what a cut result says — the note's text, or the
``continuation`` recorded on the ``tool_result`` event — and check that the pieces
put together are exactly the file.
"""

from __future__ import annotations

import json
import random
import re
import resource
import threading
import tracemalloc
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agentnb import Workspace
from agentnb.engine.tokens import counter_for_model
from agentnb.tools.base import ToolContext, ToolOutput, get_tool

COUNTER = counter_for_model("gpt-4o")
_NOTE = re.compile(r"call Read with path='([^']*)' and (.*?); or use Grep")


def _ctx(root: Path, budget: int) -> ToolContext:
    return ToolContext(workdir=root, logs_dir=root / "logs", budget_tokens=budget, chars_per_token=3.5,
                       count_tokens=COUNTER.count)


def _read(ctx: ToolContext, **args: Any) -> ToolOutput:
    return get_tool("Read").invoke(ctx, args)  # type: ignore[union-attr]


def _hint_from_note(content: str) -> dict[str, Any]:
    """The arguments the note tells the model to use next, parsed from its text alone."""
    m = _NOTE.search(content)
    assert m, f"no continuation hint in {content[-300:]!r}"
    args: dict[str, Any] = {"path": m.group(1)}
    for part in m.group(2).split(" and "):
        key, _, value = part.partition("=")
        args[key] = int(value)
    return args


def _shapes() -> dict[str, str]:
    mixed = "".join(
        ("😀é中" * (i % 17)) + f" line {i} ü " + ("ß" * ((i * 131) % 7000 if i % 97 == 0 else i % 40)) + "\n"
        for i in range(3000)
    )
    return {
        "short-lines.txt": "".join(f"{i}\n" for i in range(40_000)),
        "one-huge-line.txt": ("abc déf 中文 🎉 " * 20_000).strip(),
        "mixed-utf8.md": mixed,
        "no-trailing-newline.txt": "".join(f"row {i}: value\n" for i in range(5_000)) + "the end, no newline",
        "crlf.csv": "".join(f"{i},naïve,{'x' * (i % 30)}\r\n" for i in range(8_000)),
        "empty.txt": "",
        "only-newlines.txt": "\n" * 30_000,
    }


def _follow(ctx: ToolContext, path: str, first: dict[str, Any], via: str, budget: int) -> Iterator[ToolOutput]:
    args = {"path": path, **first}
    for _ in range(100_000):
        out = _read(ctx, **args)
        assert not out.is_error, out.content
        assert COUNTER.count(out.content) <= budget  # the note is inside the budget too
        yield out
        if not out.truncated:
            return
        assert "truncated automatically" in out.content and "Grep" in out.content
        hint = _hint_from_note(out.content)
        assert hint == out.continuation  # the text and the recorded dict say the same
        args = hint if via == "note" else dict(out.continuation or {})
    raise AssertionError("never reached the end")


@pytest.mark.parametrize("via", ["note", "continuation"])
@pytest.mark.parametrize("name", list(_shapes()))
def test_following_the_hints_reassembles_the_file_exactly(tmp_path: Path, name: str, via: str) -> None:
    text = _shapes()[name]
    (tmp_path / name).write_bytes(text.encode("utf-8"))
    budget = 700
    pieces = list(_follow(_ctx(tmp_path, budget), name, {}, via, budget))
    body = "".join(p.content[: p.returned_chars] for p in pieces)
    assert body == text
    if len(text) > 10_000:
        # as few pieces as the budget allows, no fewer: a rest that fits is returned whole
        assert len(pieces) >= max(2, -(-COUNTER.count(text) // budget))
    for p in pieces[:-1]:
        assert p.truncated and p.returned_chars < p.original_chars
    line_oriented = name in ("short-lines.txt", "crlf.csv", "no-trailing-newline.txt", "only-newlines.txt")
    if line_oriented:  # cut at line boundaries, continued by line number
        assert all(p.content[: p.returned_chars].endswith("\n") for p in pieces[:-1])
        assert all("offset" in (p.continuation or {}) for p in pieces[:-1])
    if name == "one-huge-line.txt":  # few newlines: by bytes, never splitting a character
        assert all("byte_offset" in (p.continuation or {}) for p in pieces[:-1])
        assert "returned bytes 0–" in pieces[0].content


def test_invalid_utf8_reassembles_as_the_whole_file_decoded_with_replacement(tmp_path: Path) -> None:
    # What "exactly" means for bytes that are not UTF-8: the pieces give what the whole file decoded with
    # errors="replace" gives.  Valid characters next to stray continuation bytes must not be split.
    data = (b"\xe2\x82\xac\x80\x80" + "😀".encode() + b"\x80\x80ab\xe0\x80\xed\xa0\x80caf\xe9 ") * 3000
    (tmp_path / "bad.txt").write_bytes(data)
    for budget in (120, 121, 122, 123, 700):
        pieces = list(_follow(_ctx(tmp_path, budget), "bad.txt", {}, "note", budget))
        assert len(pieces) > 2
        assert "".join(_body(p) for p in pieces) == data.decode("utf-8", errors="replace"), budget


def test_a_utf8_cut_never_changes_how_the_bytes_decode() -> None:
    from agentnb.tools.truncate import _utf8_cut

    rng = random.Random(5)
    alphabet = [b"a", b"\n", b"\x80", b"\xbf", b"\x9f", b"\xa0", b"\xc2", b"\xe2", b"\xe0", b"\xed", b"\xf0",
                b"\xf4", b"\xf5", b"\xff", "€".encode(), "😀".encode(), "é".encode()]
    for _ in range(1500):
        data = b"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24)))
        whole = data.decode("utf-8", errors="replace")
        for n in range(1, len(data) + 1):
            cut = _utf8_cut(data, n)
            assert 1 <= cut <= len(data) and (cut <= n or cut <= 4)
            assert data[:cut].decode("utf-8", errors="replace") + data[cut:].decode("utf-8", errors="replace") == whole


def test_notes_say_how_much_of_how_much(tmp_path: Path) -> None:
    text = "".join(f"line {i}\n" for i in range(1, 5001))
    (tmp_path / "a.txt").write_text(text)
    out = _read(_ctx(tmp_path, 300), path="a.txt")
    assert out.truncated
    n = out.continuation["offset"] - 1  # type: ignore[index]
    assert f"returned lines 1–{n:,} of the 5,000 lines of a.txt" in out.content
    assert f"({out.returned_chars:,} of {len(text):,} characters requested)" in out.content
    assert out.original_chars == len(text)
    assert out.content[: out.returned_chars] == "".join(f"line {i}\n" for i in range(1, n + 1))
    (tmp_path / "b.txt").write_text("é" * 50_000)
    out = _read(_ctx(tmp_path, 300), path="b.txt")
    end = out.continuation["byte_offset"]  # type: ignore[index]
    assert f"returned bytes 0–{end - 1:,} of the 100,000 bytes of b.txt" in out.content
    assert out.original_chars == 50_000 and out.returned_chars == end // 2


@pytest.mark.parametrize("shape", ["lines", "one line"])
def test_a_file_that_fits_the_budget_is_returned_whole(tmp_path: Path, shape: str) -> None:
    # ~4 characters per token here, more than the byte budget's first guess of 3.5
    text = "hello world\n" * 300 if shape == "lines" else "hello world " * 300
    (tmp_path / "f.txt").write_text(text)
    tokens = COUNTER.count(text)
    for budget in (tokens, tokens + 5, tokens + 100):
        out = _read(_ctx(tmp_path, budget), path="f.txt")
        assert (out.truncated, out.content) == (False, text), budget
    assert _read(_ctx(tmp_path, tokens - 1), path="f.txt").truncated


def test_offset_and_limit_ranges(tmp_path: Path) -> None:
    lines = [f"{i:05d} {'word ' * (i % 13)}\n" for i in range(1, 20_001)]
    (tmp_path / "f.txt").write_text("".join(lines))
    ctx = _ctx(tmp_path, 400)
    small = _read(ctx, path="f.txt", offset=5, limit=3)
    assert (small.content, small.truncated) == ("".join(lines[4:7]), False)
    tail = _read(ctx, path="f.txt", offset=19_999, limit=50)
    assert tail.content == "".join(lines[19_998:])
    # a large range, cut and continued with the remaining limit, gives exactly the range
    pieces = list(_follow(ctx, "f.txt", {"offset": 1_000, "limit": 2_500}, "note", 400))
    assert len(pieces) > 2
    assert pieces[0].continuation is not None and "limit" in pieces[0].continuation
    assert "".join(p.content[: p.returned_chars] for p in pieces) == "".join(lines[999:3_499])
    assert pieces[0].original_chars == len("".join(lines[999:3_499]))
    # byte_offset with limit: that many lines from that byte
    start = len("".join(lines[:10]).encode())
    out = _read(ctx, path="f.txt", byte_offset=start + 2, limit=2)
    assert out.content == lines[10][2:] + lines[11]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"offset": 4}, "offset=4 is past the end of 'f.txt', which has 3 lines"),
        ({"offset": 0}, "offset=0: lines are numbered from 1"),
        ({"limit": 0}, "limit=0: give at least 1 line"),
        ({"byte_offset": 12}, "byte_offset=12 is outside 'f.txt', which has 12 bytes (allowed: 0–11)"),
        ({"byte_offset": -1}, "byte_offset=-1 is outside"),
        ({"offset": 2, "byte_offset": 3}, "give either offset"),
        ({"offset": "2"}, "offset='2'; allowed: a whole number"),
    ],
)
def test_read_argument_errors(tmp_path: Path, args: dict[str, Any], message: str) -> None:
    (tmp_path / "f.txt").write_text("one\ntwo\nsix\n")
    out = _read(_ctx(tmp_path, 500), path="f.txt", **args)
    assert out.is_error
    assert message in out.content


def test_read_refuses_binary_directories_and_escapes(tmp_path: Path) -> None:
    (tmp_path / "bin.dat").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / "sub").mkdir()
    ctx = _ctx(tmp_path, 500)
    assert "binary file" in _read(ctx, path="bin.dat").content
    assert "is a directory" in _read(ctx, path="sub").content
    assert "leaves the work directory" in _read(ctx, path="../x").content


def test_a_file_rewritten_between_reads_is_indexed_anew(tmp_path: Path) -> None:
    p = tmp_path / "f.txt"
    p.write_text("".join(f"a{i}\n" for i in range(5_000)))
    ctx = _ctx(tmp_path, 200)
    _read(ctx, path="f.txt")
    p.write_text("".join(f"b{i}\n" for i in range(9_000)))
    out = _read(ctx, path="f.txt", offset=8_000, limit=1)
    assert out.content == "b7999\n"


def test_a_huge_file_is_read_in_pieces_without_loading_it(tmp_path: Path) -> None:
    block_lines = 20_000
    filler = "".join(f"{i:05d} lorem ipsum dolor sit amet\n" for i in range(1, block_lines))
    path = tmp_path / "huge.log"
    blocks = 0
    with open(path, "w", encoding="utf-8") as fh:
        while fh.tell() < 300 * 1024 * 1024:
            fh.write(f"BLOCK {blocks:06d}\n{filler}")
            blocks += 1
    size = path.stat().st_size
    ctx = _ctx(tmp_path, 60_000)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracemalloc.start()
    try:
        first = _read(ctx, path="huge.log")
        assert first.truncated and first.content.startswith("BLOCK 000000\n")
        assert f"of the {blocks * block_lines:,} lines" in first.content
        second = _read(ctx, **first.continuation)  # type: ignore[arg-type]
        assert second.truncated
        seen = first.content[: first.returned_chars] + second.content[: second.returned_chars]
        assert seen == (f"BLOCK 000000\n{filler}" * 2)[: len(seen)]
        middle = blocks // 2
        jump = _read(ctx, path="huge.log", offset=middle * block_lines + 1, limit=2)
        assert jump.content == f"BLOCK {middle:06d}\n00001 lorem ipsum dolor sit amet\n"
        near_end = _read(ctx, path="huge.log", byte_offset=size - len(filler.encode()) - 13)
        assert near_end.content.startswith(f"BLOCK {blocks - 1:06d}\n")
        pieces = 0
        out = near_end
        while out.truncated:
            out = _read(ctx, **out.continuation)  # type: ignore[arg-type]
            pieces += 1
        assert out.content.endswith("19999 lorem ipsum dolor sit amet\n")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    assert peak < 24 * 1024 * 1024, f"peak {peak:,} bytes for a {size:,}-byte file"
    assert rss_growth < size // 3
    path.unlink()


# -- Bash, Grep, Glob ------------------------------------------------------------------


def _body(out: ToolOutput) -> str:
    return out.content[: out.returned_chars]


@pytest.mark.needs("bwrap")
def test_bash_output_is_cut_with_narrowing_hints(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, 400)
    out = get_tool("Bash").invoke(ctx, {"command": "seq 1 100000"})  # type: ignore[union-attr]
    assert out.truncated and not out.is_error
    assert COUNTER.count(out.content) <= 400
    full = "".join(f"{i}\n" for i in range(1, 100_001))
    assert full.startswith(_body(out)) and _body(out).endswith("\n")
    assert out.original_chars == len(full)
    for word in ("head", "tail", "grep", "awk", "sed", "truncated automatically"):
        assert word in out.content
    assert f"of {len(full):,} characters" in out.content and "of 100,000 lines" in out.content
    small = get_tool("Bash").invoke(ctx, {"command": "echo hi"})  # type: ignore[union-attr]
    assert (small.content, small.truncated) == ("hi\n", False)


@pytest.mark.needs("bwrap")
def test_a_cut_bash_output_still_tells_the_exit_code_and_the_stderr(tmp_path: Path) -> None:
    # stderr and the exit code come after a large stdout: the note must not let the cut hide them
    out = get_tool("Bash").invoke(  # type: ignore[union-attr]
        _ctx(tmp_path, 400), {"command": "seq 1 100000; echo 'fatal: disk full' >&2; exit 3"})
    assert out.truncated and out.is_error
    assert COUNTER.count(out.content) <= 400
    note = out.content[out.returned_chars:]
    assert "exit code 3" in note
    assert f"stdout {len(''.join(f'{i}' + chr(10) for i in range(1, 100_001))):,} characters" in note
    assert "stderr 17 characters" in note and "2>&1 >/dev/null" in note


def test_grep_output_is_cut_and_counts_every_match(tmp_path: Path) -> None:
    (tmp_path / "log.txt").write_text("".join(f"{i} ERROR something failed\n" for i in range(20_000)))
    ctx = _ctx(tmp_path, 500)
    out = get_tool("Grep").invoke(ctx, {"pattern": "ERROR"})  # type: ignore[union-attr]
    assert out.truncated
    assert COUNTER.count(out.content) <= 500
    assert "(20,000 matching lines in all.)" in out.content
    assert "more specific pattern" in out.content
    assert _body(out).startswith("log.txt:1:0 ERROR something failed\n")


def test_grep_shows_a_long_line_around_its_match_and_says_where_to_read_on(tmp_path: Path) -> None:
    prefix = b"\xff\xfe" + ("é" * 3000 + "x" * 4000).encode("utf-8")  # invalid and multi-byte before the match
    (tmp_path / "big.txt").write_bytes(b"short line\n" + prefix + b"NEEDLE" + b"y" * 20_000 + b"\n")
    out = get_tool("Grep").invoke(_ctx(tmp_path, 2_000), {"pattern": "NEEDLE"})  # type: ignore[union-attr]
    assert not out.is_error
    assert out.content.startswith("big.txt:2:…") and "NEEDLE" in out.content
    assert out.truncated and out.original_chars > 27_000 > out.returned_chars
    assert "a line of 27,008 characters, cut around the match" in out.content
    hint = re.search(r"Read path='big.txt' byte_offset=(\d+)", out.content)
    assert hint
    shown = out.content.split(":", 2)[2][1:].split("… [a line", 1)[0]
    piece = _read(_ctx(tmp_path, 200), path="big.txt", byte_offset=int(hint.group(1)))
    assert piece.content.startswith(shown[:200]) and shown.startswith("xxx")


def test_glob_output_is_cut(tmp_path: Path) -> None:
    for i in range(600):
        (tmp_path / f"file_{i:04d}.py").write_text("x")
    out = get_tool("Glob").invoke(_ctx(tmp_path, 300), {"pattern": "*.py"})  # type: ignore[union-attr]
    assert out.truncated
    assert COUNTER.count(out.content) <= 300
    assert "Narrow the pattern" in out.content
    assert _body(out).startswith("file_0000.py  (1 bytes)\n")


@pytest.mark.parametrize("budget", [30, 200, 5_000])
def test_cut_text_fits_dense_text_exactly(tmp_path: Path, budget: int) -> None:
    # characters that take several tokens each: a characters-per-token guess would overflow
    from agentnb.tools.truncate import cut_text

    text = "".join(chr(0x1F300 + (i * 7) % 700) + chr(0x4E00 + (i * 13) % 20000) for i in range(20_000))
    out = cut_text(text, _ctx(tmp_path, budget), hint="bash")
    assert out.truncated
    assert COUNTER.count(out.content) <= budget or out.returned_chars == 1
    assert text.startswith(_body(out)) and out.returned_chars > 0


# -- end to end: a model on loopback that only follows the notes ----------------------------


class _Follower:
    """An OpenAI-compatible endpoint whose 'model' reads a file by following each note's hint."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.calls: list[dict[str, Any]] = []
        follower = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                tools = [m for m in body["messages"] if m["role"] == "tool"]
                if not tools:
                    name, args = "Read", {"path": follower.path}
                elif "truncated automatically" in tools[-1]["content"]:
                    name, args = "Read", _hint_from_note(tools[-1]["content"])
                else:
                    name, args = "transition", {"next_step": "COMPLETE", "summary": "read it all"}
                follower.calls.append(args)
                n = len(follower.calls)
                data = json.dumps({
                    "id": f"c{n}", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                        "role": "assistant", "content": None,
                        "tool_calls": [{"id": f"call{n}", "type": "function",
                                        "function": {"name": name, "arguments": json.dumps(args)}}]}}],
                }).encode()  # no usage: the ContextManager counts with the offline tokenizer
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> _Follower:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("name", ["mixed-utf8.md", "one-huge-line.txt"])
def test_a_model_following_the_notes_reads_the_whole_file(ws: Workspace, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    text = _shapes()[name][:120_000]
    # a window the file nearly fills: the halving budgets need several pieces, yet everything fits
    window = int(COUNTER.count(text) * 1.2) + 3_000
    piece = tmp_path / "reader.yaml"
    piece.write_text(
        "name: reader\nmovements:\n  - name: read\n    persona: You read.\n    instruction: Read the file.\n"
        "    tools: [Read]\n    max_iterations: 60\n    rules:\n      - {condition: done, next: COMPLETE}\n"
    )
    with _Follower(f"input/{name}") as server:
        host, port = server.httpd.server_address[:2]
        monkeypatch.setenv("OPENAI_BASE_URL", f"http://{host}:{port}/v1")
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-a-real-key")
        job = ws.submit("Read it", piece=str(piece), model="openai:gpt-4o", inputs={name: text},
                        context={"window_tokens": window,
                                 "thresholds": {"warn": 1.0, "prompt": 1.0, "force_transition": 1.0, "exhausted": 1.0}})
        job = ws.run(job)
    assert job.status == "succeeded", job.error
    events = ws.events(job)
    results = [e.payload for e in events if e.kind == "tool_result" and e.payload["tool"] == "Read"]
    calls = [e.payload["arguments"] for e in events if e.kind == "tool_call" and e.payload["tool"] == "Read"]
    assert len(results) >= 3
    assert "".join(r["content"][: r["returned_chars"]] for r in results) == text
    for r, next_call in zip(results, calls[1:], strict=False):
        assert r["truncated"] and r["continuation"] == next_call
        assert COUNTER.count(r["content"]) <= r["budget_tokens"]
    assert not results[-1]["truncated"] and results[-1]["continuation"] is None
    assert {e.payload["usage"]["source"] for e in events if e.kind == "llm_response"} == {"tiktoken"}
    budgets = [r["budget_tokens"] for r in results]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] <= window // 2  # half of what is left, shrinking


@pytest.mark.needs("bwrap")
def test_bash_keeps_only_a_bounded_head_of_a_huge_output(tmp_path: Path) -> None:
    # 200 MB of output: only the head is held, the rest is counted, so memory stays small
    import tracemalloc

    ctx = _ctx(tmp_path, 400)
    tracemalloc.start()
    try:
        out = get_tool("Bash").invoke(  # type: ignore[union-attr]
            ctx, {"command": "yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c 200000000"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.truncated and not out.is_error
    assert out.original_chars == 200_000_000
    assert "of 200,000,000 characters" in out.content and "of 5,405,406 lines" in out.content
    assert _body(out).startswith("0123456789abcdefghijklmnopqrstuvwxyz\n")
    assert peak < 20_000_000, peak
