"""Piece loading and validation: every bad piece gets one line naming file, line, field, found and allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
from _scripting import write_piece

import agentnb
from agentnb import Workspace
from agentnb.engine.pieces import PACKAGE_PIECES, PieceError, available_pieces, load_piece, parse_piece

OK = """name: ok
movements:
  - name: a
    instruction: do a
    rules:
      - {condition: done, next: b}
  - name: b
    instruction: do b
    rules:
      - {condition: done, next: COMPLETE}
"""

MV = "name: x\nmovements:\n  - name: a\n    instruction: do\n"
# (id, yaml, line, field, [what was found], [what is allowed])
BROKEN = [
    ("unknown top key", "name: x\nfoo: 1\nmovements:\n  - name: a\n    instruction: do\n",
     2, "foo", ["'foo'"], ["name, description, initial_movement, max_movements, language, context, movements"]),
    ("unknown movement key", MV + "    toolz: [Read]\n",
     5, "movements[0].toolz", ["'toolz'"], ["tools", "permission", "max_iterations", "rules"]),
    ("unknown rule key", MV + "    rules:\n      - {condition: c, nxt: COMPLETE}\n",
     6, "movements[0] (a).rules[0].nxt", ["'nxt'"], ["condition, next"]),
    ("unknown context key", "name: x\ncontext:\n  windw: 5\n" + MV[8:],
     3, "context.windw", ["'windw'"], ["window_tokens, thresholds, min_tool_tokens"]),
    ("unknown threshold key", "name: x\ncontext:\n  thresholds: {alarm: 0.5}\n" + MV[8:],
     3, "context.thresholds.alarm", ["'alarm'"], ["warn, prompt, force_transition, exhausted"]),
    ("unknown rules.next", MV + "    rules:\n      - {condition: c, next: b}\n",
     6, "movements[0] (a).rules[0].next", ["'b'"], ["a, COMPLETE, ASK, ABORT, WAIT_SUBTASKS"]),
    ("unknown default_next", MV + "    default_next: zz\n",
     5, "movements[0] (a).default_next", ["'zz'"], ["a, COMPLETE, ASK, ABORT, WAIT_SUBTASKS"]),
    ("unknown verify", MV + "    verify: zz\n  - name: b\n    instruction: do b\n",
     5, "movements[0] (a).verify", ["'zz'"], ["allowed: b"]),
    ("verify itself", MV + "    verify: a\n",
     5, "movements[0] (a).verify", ["'a'"], ["allowed: none"]),
    ("unknown initial_movement", "name: x\ninitial_movement: q\n" + MV[8:],
     2, "initial_movement", ["'q'"], ["allowed: a"]),
    ("tools as a string", MV + "    tools: Read\n",
     5, "movements[0] (a).tools", ["'Read'"], ["expected a list"]),
    ("rules as a mapping", MV + "    rules: {condition: c, next: COMPLETE}\n",
     5, "movements[0] (a).rules", ["a mapping"], ["expected a list"]),
    ("movements as a mapping", "name: x\nmovements:\n  a: {instruction: do}\n",
     3, "movements", ["a mapping"], ["expected a list"]),
    ("a rule as a string", MV + "    rules: [COMPLETE]\n",
     5, "movements[0] (a).rules[0]", ["'COMPLETE'"], ["expected a mapping"]),
    ("context as a list", "name: x\ncontext: [1, 2]\n" + MV[8:],
     2, "context", ["a list"], ["expected a mapping"]),
    ("max_iterations text", MV + "    max_iterations: lots\n",
     5, "movements[0] (a).max_iterations", ["'lots'"], ["whole number ≥ 1"]),
    ("max_iterations float", MV + "    max_iterations: 2.5\n",
     5, "movements[0] (a).max_iterations", ["'2.5'"], ["whole number ≥ 1"]),
    ("max_iterations zero", MV + "    max_iterations: 0\n",
     5, "movements[0] (a).max_iterations", ["found 0"], ["whole number ≥ 1"]),
    ("max_movements negative", "name: x\nmax_movements: -1\n" + MV[8:],
     2, "max_movements", ["found -1"], ["whole number ≥ 1"]),
    ("bad permission", MV + "    permission: root\n",
     5, "movements[0] (a).permission", ["'root'"], ["readonly, edit, full"]),
    ("bad language", "name: x\nlanguage: fr\n" + MV[8:],
     2, "language", ["'fr'"], ["en, ja"]),
    ("threshold above 1", "name: x\ncontext:\n  thresholds: {warn: 1.5}\n" + MV[8:],
     3, "context.thresholds.warn", ["1.5"], ["between 0 (excluded) and 1"]),
    ("threshold zero", "name: x\ncontext:\n  thresholds: {warn: 0}\n" + MV[8:],
     3, "context.thresholds.warn", ["found 0"], ["between 0 (excluded) and 1"]),
    ("threshold text", "name: x\ncontext:\n  thresholds: {warn: high}\n" + MV[8:],
     3, "context.thresholds.warn", ["'high'"], ["between 0 and 1"]),
    ("thresholds not ascending", "name: x\ncontext:\n  thresholds:\n    warn: 0.9\n    prompt: 0.8\n" + MV[8:],
     4, "context.thresholds.warn", ["warn=0.9 above prompt=0.8"], ["warn ≤ prompt ≤ force_transition ≤ exhausted"]),
    ("missing name", "movements:\n  - name: a\n    instruction: do\n",
     1, "name", ["found keys: movements"], ["missing required key 'name'"]),
    ("missing movements", "name: x\ndescription: y\n",
     1, "movements", ["found keys: name, description"], ["missing required key 'movements'"]),
    ("empty movements", "name: x\nmovements: []\n",
     2, "movements", ["an empty list"], ["at least one movement"]),
    ("missing instruction", "name: x\nmovements:\n  - name: a\n    persona: p\n",
     3, "movements[0] (a).instruction", ["found keys: name, persona"], ["'instruction' (or 'instruction_file')"]),
    ("missing movement name", "name: x\nmovements:\n  - instruction: do\n",
     3, "movements[0].name", ["found keys: instruction"], ["missing required key 'name'"]),
    ("missing rule next", MV + "    rules:\n      - {condition: c}\n",
     6, "movements[0] (a).rules[0].next", ["found keys: condition"], ["missing required key 'next'"]),
    ("duplicate movement", MV + "  - name: a\n    instruction: again\n",
     5, "movements[1].name", ["duplicate movement name 'a'"], ["first defined at line 3"]),
    ("duplicate key", "name: x\nname: y\n" + MV[8:],
     2, "name", ["'name' appears twice"], ["key"]),
    ("reserved movement name", "name: x\nmovements:\n  - name: COMPLETE\n    instruction: do\n",
     3, "movements[0].name", ["'COMPLETE'"], ["reserved for a special next step"]),
    ("unknown tool", MV + "    tools: [Read, Frobnicate]\n",
     5, "movements[0] (a).tools[1]", ["'Frobnicate'"], ["Read, Glob, Grep", "Bash"]),
    ("name as a list", "name: [a]\n" + MV[8:],
     1, "name", ["a list"], ["expected text"]),
    ("instruction as a mapping", "name: x\nmovements:\n  - name: a\n    instruction: {a: 1}\n",
     4, "movements[0] (a).instruction", ["a mapping"], ["expected text"]),
    ("both persona and persona_file", MV + "    persona: p\n    persona_file: p.md\n",
     6, "movements[0] (a).persona_file", ["persona"], ["either persona or persona_file"]),
    ("missing persona_file", MV + "    persona_file: nope.md\n",
     5, "movements[0] (a).persona_file", ["nope.md"], ["cannot read"]),
    ("invalid YAML: unclosed list", "name: x\nmovements:\n  - name: a\n    instruction: [do\n",
     4, "movements[0].instruction", ["'instruction: [do'"], ["not valid YAML"]),
    ("invalid YAML: bad indent", "name: x\n  bad: indent\nmovements: 1\n",
     2, "name.bad", ["'bad: indent'"], ["not valid YAML"]),
    ("invalid YAML: tab", "name: x\nmovements:\n\t- name: a\n",
     3, "movements[0].name", ["'- name: a'"], ["spaces, not tabs"]),
    ("invalid YAML: unclosed quote", OK + "  - name: c\n    instruction: \"unterminated\n    tools: [Read]\n",
     12, "movements[2].instruction", ["unterminated"], ["not valid YAML"]),
    ("empty file", "", 1, "(top level)", ["an empty file"], ["name and movements"]),
    ("only a comment", "# nothing here\n\n", 1, "(top level)", ["an empty file"], ["name and movements"]),
    ("a list at the top", "- a\n- b\n", 1, "(top level)", ["a list"], ["expected a mapping"]),
    ("a tagged value", "name: !!python/object:os.system x\n" + MV[8:],
     1, "name", ["'!!python/object:os.system'"], ["expected plain text"]),
    ("a tool listed twice", MV + "    tools: [Read, Glob, Read]\n",
     5, "movements[0] (a).tools[2]", ["'Read' a second time"], ["list each tool once"]),
]


@pytest.mark.parametrize("case", BROKEN, ids=[c[0] for c in BROKEN])
def test_broken_piece_error_is_one_precise_line(tmp_path: Path, case) -> None:
    _, text, line, field, found, allowed = case
    path = write_piece(tmp_path, "broken", text)
    with pytest.raises(PieceError) as info:
        load_piece(path)
    err = info.value
    message = str(err)
    assert "\n" not in message
    assert message.startswith(f"{path}:{line}: {field}: "), message
    assert (err.file, err.line, err.field) == (str(path), line, field)
    for text_ in found + allowed:
        assert text_ in message, f"{text_!r} not in {message!r}"


def test_valid_piece_parses_and_round_trips(tmp_path: Path) -> None:
    piece = load_piece(write_piece(tmp_path, "piece", OK))
    assert piece.names == ("a", "b")
    assert piece.initial_movement == "a"
    assert piece.movement("a").next_steps[:1] == ("b",)
    assert parse_piece(piece.to_yaml()) == parse_piece(piece.to_yaml())
    again = parse_piece(piece.to_yaml(), source=piece.source)
    assert again == piece


def test_shipped_pieces_are_valid() -> None:
    names = {p.stem for p in PACKAGE_PIECES.glob("*.yaml")}
    assert {"single", "plan-implement-verify", "ask-first"} <= names
    for name in names:
        load_piece(PACKAGE_PIECES / f"{name}.yaml")
    piv = load_piece("plan-implement-verify")
    assert piv.movement("verify").verify == "implement"
    assert "implement" in piv.movement("verify").next_steps
    assert any(r.next == "ASK" for m in load_piece("ask-first").movements for r in m.rules)
    assert len(load_piece("single").movements) == 1


def test_load_by_name_prefers_cwd_pieces_then_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pieces").mkdir()
    write_piece(tmp_path / "pieces", "local", OK.replace("name: ok", "name: local"))
    write_piece(tmp_path / "pieces", "single", OK.replace("name: ok", "name: my-single"))
    monkeypatch.chdir(tmp_path)
    assert load_piece("local").name == "local"
    assert load_piece("single").name == "my-single"  # ./pieces wins over the package
    assert Path(load_piece("single").source) == tmp_path / "pieces" / "single.yaml"
    assert load_piece("plan-implement-verify").source == str(PACKAGE_PIECES / "plan-implement-verify.yaml")
    assert set(available_pieces()) >= {"local", "single", "plan-implement-verify"}
    with pytest.raises(PieceError, match=r"unknown piece 'nope'; available: .*local.*plan-implement-verify"):
        load_piece("nope")
    with pytest.raises(PieceError, match="no such piece file"):
        load_piece("pieces/nope.yaml")


def test_files_are_read_relative_to_the_piece_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "deep" / "pieces"
    (folder / "prompts").mkdir(parents=True)
    (folder / "prompts" / "persona.md").write_text("You are from a file.", encoding="utf-8")
    (folder / "prompts" / "task.md").write_text("Instruction from a file.", encoding="utf-8")
    path = write_piece(folder, "f", "name: f\nmovements:\n  - name: a\n    persona_file: prompts/persona.md\n"
                               "    instruction_file: prompts/task.md\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    piece = load_piece(path)
    assert piece.movement("a").persona == "You are from a file."
    assert piece.movement("a").instruction == "Instruction from a file."
    # the stored YAML inlines the files, so the job no longer depends on them
    assert "Instruction from a file." in piece.to_yaml()


def test_user_tool_can_be_named_in_a_piece(tmp_path: Path) -> None:
    @agentnb.tool
    def shout_piece_test(text: str) -> str:
        """Shout."""
        return text.upper()

    try:
        piece = load_piece(write_piece(tmp_path, "piece", MV + "    tools: [Read, shout_piece_test]\n"))
        assert piece.movement("a").tools == ("Read", "shout_piece_test")
    finally:
        agentnb.tools.base.unregister("shout_piece_test")
    with pytest.raises(PieceError, match="unknown tool 'shout_piece_test'"):
        load_piece(write_piece(tmp_path, "piece", MV + "    tools: [Read, shout_piece_test]\n"))


@pytest.mark.parametrize("case", BROKEN[:8] + BROKEN[-4:], ids=[c[0] for c in BROKEN[:8] + BROKEN[-4:]])
def test_a_bad_piece_never_creates_a_job(ws: Workspace, tmp_path: Path, case) -> None:
    path = write_piece(tmp_path, "broken", case[1])
    with pytest.raises(PieceError):
        ws.submit("task", piece=str(path), model="demo")
    assert ws.jobs() == []
    assert ws.store.query("SELECT COUNT(*) FROM events")[0][0] == 0
    assert not (ws.root / "jobs").exists() or not any((ws.root / "jobs").iterdir())


def test_a_piece_that_is_not_utf8_is_refused_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"name: x\nmovements:\n  - name: a\n    instruction: caf\xe9\n")
    with pytest.raises(PieceError) as info:
        load_piece(path)
    assert str(info.value) == (f"{path}:4: movements[0].instruction: found byte 0xe9, which is not UTF-8; "
                               "allowed: UTF-8 text (save the file as UTF-8)")
    (tmp_path / "persona.md").write_bytes(b"\xff\xfe")
    path = write_piece(tmp_path, "piece", MV + "    persona_file: persona.md\n")
    with pytest.raises(PieceError, match=r":5: movements\[0\] \(a\)\.persona_file: found .*not UTF-8"):
        load_piece(path)


def test_a_piece_that_is_not_a_name_path_or_piece_is_one_clear_error(ws: Workspace) -> None:
    with pytest.raises(PieceError, match=r"^<piece>: piece: piece must be a name, a YAML path or a Piece, not int 123$"):
        ws.submit("x", piece=123)  # type: ignore[arg-type]
    assert ws.jobs() == []


def test_a_host_file_named_as_a_piece_is_not_echoed_whole(tmp_path: Path) -> None:
    # a file that is not a piece (named by mistake, or by an attacker) must not come back whole in the error
    long_line = "secret-" + "x" * 500
    path = tmp_path / "notes.yaml"
    path.write_text(long_line + "\n", encoding="utf-8")
    with pytest.raises(PieceError) as info:
        load_piece(path)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300 and "…" in message and long_line not in message


# -- files a piece names stay inside its folder -------------------------------------------------------------------

SECRET = "host-secret-7f3a"


def _quoted(value: str) -> str:
    """A value as a piece error quotes it: cut after 80 characters (a temporary folder's path may be longer)."""
    return repr(value if len(value) <= 80 else value[:80] + "…")


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Path]:
    """A piece folder with a prompt inside it, a secret outside it and links to both."""
    folder, outside = tmp_path / "piece", tmp_path / "outside"
    (folder / "prompts").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET, encoding="utf-8")
    (folder / "prompts" / "task.md").write_text("Task from a file.", encoding="utf-8")
    (folder / "out.md").symlink_to(outside / "secret.txt")
    (folder / "in.md").symlink_to(folder / "prompts" / "task.md")
    (folder / "loop.md").symlink_to(folder / "loop.md")
    return {"folder": folder, "secret": outside / "secret.txt"}


@pytest.mark.parametrize("key", ["persona_file", "instruction_file"])
@pytest.mark.parametrize("ref, found", [
    ("ABS", "an absolute path; allowed: a path relative to the piece's folder ({folder!r})"),
    ("../outside/secret.txt", "a '..' that leads out of the piece's folder ({folder!r}); allowed: a file inside it"),
    ("prompts/../../outside/secret.txt", "a '..' that leads out of the piece's folder ({folder!r}); allowed: a file "
                                         "inside it"),
    ("out.md", "a link that leads out of the piece's folder ({folder!r}); allowed: a file inside it"),
], ids=["absolute", "dotdot", "dotdot-inside", "symlink"])
def test_a_piece_file_cannot_name_a_file_outside_its_folder(ws: Workspace, host: dict[str, Path], key: str,
                                                            ref: str, found: str) -> None:
    ref = str(host["secret"]) if ref == "ABS" else ref
    other = "    instruction: do\n" if key == "persona_file" else ""
    path = write_piece(host["folder"], "piece", f"name: x\nmovements:\n  - name: a\n{other}    {key}: {ref}\n")
    line = 5 if other else 4
    with pytest.raises(PieceError) as info:
        load_piece(path)
    folder = str(host["folder"].resolve())
    assert str(info.value) == (f"{path}:{line}: movements[0] (a).{key}: found {_quoted(ref)}, "
                               + found.format(folder=folder))
    with pytest.raises(PieceError):
        ws.submit("task", piece=str(path), model="demo")
    assert ws.jobs() == [] and SECRET not in str(info.value)


def test_yaml_text_and_piece_objects_name_files_inside_the_current_folder(
    host: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(host["folder"])
    folder = str(host["folder"].resolve())
    text = "name: t\nmovements:\n  - name: a\n    instruction_file: {}\n"
    with pytest.raises(PieceError) as info:
        load_piece(text.format("../outside/secret.txt"))
    assert str(info.value) == (f"<piece text>:4: movements[0] (a).instruction_file: found '../outside/secret.txt', "
                               f"a '..' that leads out of the current folder ({folder!r}); allowed: a file inside it")
    # a Piece object is made by parse_piece, which reads its files at that moment, under the same rule
    with pytest.raises(PieceError) as info:
        parse_piece(text.format(host["secret"]))
    assert str(info.value) == (f"<piece>:4: movements[0] (a).instruction_file: found {_quoted(str(host['secret']))}, "
                               f"an absolute path; allowed: a path relative to the current folder ({folder!r})")
    with pytest.raises(PieceError, match=r"^<piece>:4: movements\[0\] \(a\)\.instruction_file: found 'out.md', a link "):
        parse_piece(text.format("out.md"))
    # parse_piece(base_dir=) makes that folder the piece's: a file beside it is outside
    with pytest.raises(PieceError, match=r"^elsewhere:4: .*found '\.\./task\.md', a '\.\.' that leads out of the piece's"):
        parse_piece(text.format("../task.md"), source="elsewhere", base_dir=host["folder"] / "prompts" / "x")
    piece = load_piece(text.format("prompts/task.md"))
    assert piece.movement("a").instruction == "Task from a file."
    assert parse_piece(text.format("task.md"), base_dir=host["folder"] / "prompts").movement("a").instruction == \
        "Task from a file."
    # a Piece object holds texts, not file names: its files cannot be named again later
    with pytest.raises(PieceError, match=r"unknown key\(s\) \['instruction_file'\]"):
        piece.replace_movement("a", instruction_file="../outside/secret.txt")
    assert load_piece(piece) is piece and "Task from a file." in piece.to_yaml()


def test_links_inside_a_pieces_folder_still_work(host: dict[str, Path]) -> None:
    path = write_piece(host["folder"], "piece", "name: x\nmovements:\n  - name: a\n    instruction_file: in.md\n")
    assert load_piece(path).movement("a").instruction == "Task from a file."
    path = write_piece(host["folder"], "piece", "name: x\nmovements:\n  - name: a\n    instruction_file: loop.md\n")
    with pytest.raises(PieceError) as info:
        load_piece(path)
    assert f"{path}:4: movements[0] (a).instruction_file: cannot read 'loop.md'" in str(info.value)
    assert "\n" not in str(info.value)
