"""Hardening: no host paths in tool errors, no secrets in Bash's environment or in
any stored tool result, commands die with their worker, special files and hostile regexes never hang.

Jobs that could hang without the fixes (a FIFO, a catastrophic regex, an orphaned command) run in a real
worker subprocess with a timeout, so a regression fails the test instead of blocking the suite.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, transition, write_piece, write_script
from conftest import require

import agentnb
from agentnb import Workspace
from agentnb._secrets import MASK, SECRET_NAME
from agentnb.tools.base import ToolContext, get_tool, unregister
from agentnb.views.render import job_html

ROOT = Path(agentnb.__file__).resolve().parents[1]
KEY = "sk-live-" + "Zq7" * 12  # what OPENAI_API_KEY holds in these tests


def _piece(tmp_path: Path, tools: list[str], permission: str = "full") -> Path:
    return write_piece(tmp_path, "p-" + uuid.uuid4().hex[:6], {"movements": [{
        "name": "work", "instruction": "Work.", "tools": tools, "permission": permission,
        "max_iterations": 60, "rules": [{"next": "COMPLETE"}],
    }]})


def _script(tmp_path: Path, calls: list[dict[str, Any]]) -> str:
    return write_script(tmp_path, "s-" + uuid.uuid4().hex[:6], {"work": [*calls, transition("COMPLETE")]})


def _results(ws: Workspace, job: Any) -> list[dict[str, Any]]:
    return [e.payload for e in ws.events(job, kinds=["tool_result"]) if e.payload["tool"] != "transition"]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


_RUN = "import sys; from agentnb import Workspace; print(Workspace(sys.argv[1]).run(int(sys.argv[2])).status)"


def _run_in_worker(ws: Workspace, job: Any, *, timeout: float = 120, **env: str) -> str:
    """Run ``job`` in a separate Python process (a real worker); a hang fails instead of blocking."""
    try:
        done = subprocess.run([sys.executable, "-c", _RUN, str(ws.root), str(job.id)], env=_env(**env),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job did not finish within {timeout} s: a tool blocked the worker")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _ctx(root: Path, **kw: Any) -> ToolContext:
    return ToolContext(workdir=root, logs_dir=root / "logs", **kw)


# ---------------------------------------------------------------------------
# Item 2: tool errors never show host paths

LONG = "x" * 300  # longer than a file name may be (255 bytes): the OS error names the whole path


def test_tool_errors_name_paths_relative_to_the_work_directory(ws: Workspace, tmp_path: Path) -> None:
    calls = [
        call("Read", path=LONG), call("Read", path="input/" + LONG), call("Read", path="a/" * 2100),
        call("Write", path=LONG, content="x"), call("Write", path=f"output/{LONG}/a.md", content="x"),
        call("Edit", path=LONG, old="a", new="b"), call("Grep", pattern="a", path=LONG),
        call("ReadImage", path=LONG + ".png"), call("Glob", pattern=LONG), call("Glob", pattern=f"input/{LONG}*"),
    ]
    job = ws.submit("paths", piece=str(_piece(tmp_path, ["Read", "Write", "Edit", "Grep", "ReadImage", "Glob"],
                                              "edit")), model=_script(tmp_path, calls))
    job = ws.run(job)
    assert job.status == "succeeded", job.error
    results = _results(ws, job)
    assert len(results) == len(calls)
    hosts = {str(ws.root), str(ws.root.resolve()), str(tmp_path), str(tmp_path.resolve())}
    for res in results:
        assert not any(h in res["content"] for h in hosts), res["content"][:300]
    errors = [r for r in results if r["is_error"]]
    assert len(errors) >= 8
    too_long = [(c["tool_calls"][0]["arguments"], r["content"]) for c, r in zip(calls, results, strict=False)
                if "File name too long" in r["content"]]
    assert len(too_long) >= 6
    for args, content in too_long:  # the model's own relative path is named
        assert str(args.get("path", args.get("pattern")))[:50] in content
    assert "raised OSError" not in "".join(r["content"] for r in results)  # a tool error, not a crash report


def test_any_tool_error_has_host_paths_rewritten_relative(ws: Workspace, tmp_path: Path) -> None:
    @agentnb.tool
    def leaky(ctx: ToolContext, what: str) -> str:
        """Fails naming host paths."""
        job_dir = ctx.logs_dir.parent
        raise RuntimeError(f"cannot open {ctx.workdir}/input/{what}; logs at {ctx.logs_dir}; "
                           f"store at {job_dir.parent.parent}/agentnb.sqlite; ({job_dir})")

    outside = tmp_path / "project"
    outside.mkdir()
    try:
        job = ws.run(ws.submit("leak", piece=str(_piece(tmp_path, ["leaky"], "readonly")),
                               model=_script(tmp_path, [call("leaky", what="a.md")])))
        own = ws.run(ws.submit("leak", piece=str(_piece(tmp_path, ["leaky"], "readonly")), workdir=outside,
                               model=_script(tmp_path, [call("leaky", what="b.md")])))
    finally:
        unregister("leaky")
    (res,) = _results(ws, job)
    assert res["is_error"]
    assert "cannot open input/a.md; logs at logs; store at ../../agentnb.sqlite; (.)" in res["content"]
    (res,) = _results(ws, own)
    # a work directory of the user's own: the job folder and the workspace are elsewhere, and named so
    assert "cannot open input/b.md; logs at <job folder>/logs; store at <workspace>/agentnb.sqlite" in res["content"]
    for host in (str(ws.root), str(tmp_path), str(outside)):
        assert host not in res["content"]


def test_a_similar_longer_path_is_not_rewritten(tmp_path: Path) -> None:
    from agentnb.tools.base import relative_paths

    wd = tmp_path / "jobs" / "1"
    wd.mkdir(parents=True)
    ctx = ToolContext(workdir=wd, logs_dir=wd / "logs")
    text = f"a {wd}/x, b {wd}0/y, c '{wd}', d {tmp_path}/agentnb.sqlite"
    # jobs/10 is not inside jobs/1: it is written relative to the workspace instead
    assert relative_paths(text, ctx) == "a x, b ../../jobs/10/y, c '.', d ../../agentnb.sqlite"


# ---------------------------------------------------------------------------
# Item 3: Bash's environment is an allow-list; secrets never reach a tool result

LEAKY_ENV = {
    "DATABASE_URL": "postgresql://app:db-pass-8841@db.internal:5432/prod",
    "GITHUB_PAT": "ghp_0123456789abcdefghijABCDEFGHIJ",
    "MYSQL_PWD": "mysql-pass-7719",
    "SMTP_PASS": "smtp-pass-3302",
    "NPM_CONFIG__AUTH": "bnBtLWF1dGgtdG9rZW4=",
    "SENTRY_DSN": "https://pub123@o1.ingest.sentry.io/42",
    "HTTPS_PROXY": "http://proxyuser:proxy-pass-5561@proxy.internal:3128",
    "SOME_CREDENTIALS": "cred-value-90210",
}


# the Bash tool in its bubblewrap jail: that parameter needs bwrap on the machine
JAIL = pytest.param("jail", marks=pytest.mark.needs("bwrap"))


def _sandbox(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if mode == "jail":
        require("bwrap")
        monkeypatch.delenv("AGENTNB_BASH_SANDBOX", raising=False)
    else:
        monkeypatch.setenv("AGENTNB_BASH_SANDBOX", "off")


@pytest.mark.parametrize("mode", [JAIL, "off"])
def test_bash_sees_only_allowed_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    _sandbox(mode, monkeypatch)
    for name, value in LEAKY_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LC_TIME", "C")
    monkeypatch.setenv("TZ", "UTC")
    monkeypatch.setenv("MY_TOOL_HOME", "/opt/mytool")
    monkeypatch.setenv("NOT_LISTED", "plain-value")
    monkeypatch.setenv("AGENTNB_BASH_ENV", "MY_TOOL_HOME")
    out = get_tool("Bash").invoke(_ctx(tmp_path), {"command": "env | sort"})  # type: ignore[union-attr]
    assert not out.is_error, out.content
    names = {line.split("=", 1)[0] for line in out.content.splitlines() if "=" in line}
    assert not names & set(LEAKY_ENV), names & set(LEAKY_ENV)
    for value in LEAKY_ENV.values():
        assert value not in out.content
    assert {"PATH", "HOME", "LC_TIME", "TZ", "MY_TOOL_HOME"} <= names
    assert "NOT_LISTED" not in names and "AGENTNB_BASH_ENV" not in names


def test_a_bad_extra_variable_name_is_a_clear_tool_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTNB_BASH_SANDBOX", "off")
    monkeypatch.setenv("AGENTNB_BASH_ENV", "GOOD,BAD-NAME")
    out = get_tool("Bash").invoke(_ctx(tmp_path), {"command": "echo ran"})  # type: ignore[union-attr]
    assert out.is_error and "'BAD-NAME'" in out.content and "AGENTNB_BASH_ENV" in out.content
    assert "ran" not in out.content.replace("separated", "")


def test_the_workers_environment_never_reaches_the_store_or_the_view(ws: Workspace, tmp_path: Path) -> None:
    # Unjailed, a command can read its worker's environment; the key it finds is masked before it is stored.
    marker = "visible-marker-" + uuid.uuid4().hex[:8]
    read_env = ("tr '\\0' '\\n' < /proc/$PPID/environ; "
                "w=$(cut -d' ' -f4 /proc/$PPID/stat); tr '\\0' '\\n' < /proc/$w/environ")
    leak = tmp_path / "leak"
    leak.mkdir()
    (leak / "dotenv").write_text(f"OPENAI_API_KEY={KEY}\nDB={LEAKY_ENV['DATABASE_URL']}\n")
    job = ws.submit("env", piece=str(_piece(tmp_path, ["Bash", "Read", "Grep"])), model=_script(tmp_path, [
        call("Bash", command=read_env),
        call("Bash", command=f"cat {leak}/dotenv; exit 1"),  # an error result too
        call("Bash", command=f"cp {leak}/dotenv input/.env"),
        call("Read", path="input/.env"), call("Grep", pattern="KEY", path="input"),
    ]))
    status = _run_in_worker(ws, job, OPENAI_API_KEY=KEY, AGENTNB_BASH_SANDBOX="off", AGENTNB_MARKER=marker,
                            **LEAKY_ENV)
    assert status == "succeeded"
    results = _results(ws, job)
    assert marker in results[0]["content"]  # the worker's environment was really read
    assert "OPENAI_API_KEY=" + MASK in results[0]["content"]
    assert "OPENAI_API_KEY=" + MASK in results[3]["content"] and MASK in results[4]["content"]
    html = job_html(ws, job.id, full=True)
    secrets = [KEY, "db-pass-8841", "mysql-pass-7719", "smtp-pass-3302", "proxy-pass-5561", "cred-value-90210",
               "ghp_0123456789abcdefghij"]
    for secret in secrets:
        assert secret not in html
        for f in ws.root.glob("agentnb.sqlite*"):
            assert secret.encode() not in f.read_bytes(), (secret, f.name)


def test_a_secret_cut_between_two_pieces_is_masked_in_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    for shift in range(0, 60, 3):
        (tmp_path / "f.txt").write_text("." * (2000 + shift) + KEY + "." * 3000)  # no newline: cut by bytes
        ctx = _ctx(tmp_path, budget_tokens=200, chars_per_token=4.0)
        args: dict[str, Any] = {"path": "f.txt"}
        pieces = []
        for _ in range(100):
            out = get_tool("Read").invoke(ctx, args)  # type: ignore[union-attr]
            assert not out.is_error, out.content
            pieces.append(out.content)
            if not out.continuation:
                break
            args = dict(out.continuation)
        for piece in pieces:
            for i in range(len(KEY) - 5):
                assert KEY[i:i + 6] not in piece, (shift, piece[-80:])


def test_a_secret_at_the_edge_of_a_grep_window_is_masked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Grep shows 500 characters of a long line around the match; a key may straddle either edge
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    grep = get_tool("Grep")
    assert grep is not None
    for inside in (6, 10, 20, len(KEY) - 6):
        after = "." * (1000 - 125 - inside) + KEY + "." * (1000 - len(KEY) + inside)  # edge: window's end
        before = "." * (1000 - 125 - len(KEY) + inside) + KEY + "." * (125 - inside)  # edge: its start
        (tmp_path / "a.txt").write_text(before + "NEEDLE" + "." * (369 - inside) + KEY + "." * 3000 + "\n")
        (tmp_path / "b.txt").write_text(after[:1000] + "NEEDLE" + after[1000:] + "." * 3000 + "\n")
        out = grep.invoke(_ctx(tmp_path), {"pattern": "NEEDLE"})
        assert out.content.count("NEEDLE") == 2 and "cut around the match" in out.content
        for i in range(len(KEY) - 5):
            assert KEY[i:i + 6] not in out.content, (inside, i)


def test_one_secret_name_pattern() -> None:
    for name in ("OPENAI_API_KEY", "GH_TOKEN", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "MYSQL_PWD", "SMTP_PASS",
                 "NPM_CONFIG__AUTH", "SENTRY_DSN", "GITHUB_PAT", "GOOGLE_APPLICATION_CREDENTIALS", "my_credential",
                 "PGPASSFILE_PASSWD", "SSH_PASSPHRASE"):
        assert SECRET_NAME.search(name), name
    for name in ("PATH", "PWD", "OLDPWD", "HOME", "LANG", "TERM", "GIT_AUTHOR_NAME", "PASSENGER_APP", "PATHEXT",
                 "DATABASE_URL", "USER"):
        assert not SECRET_NAME.search(name), name


def test_export_masks_a_credential_named_variable(ws: Workspace, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # export's own pattern used to miss CREDENTIAL, which Bash's filter caught
    secret = "cred-0123456789-abcdef"
    monkeypatch.setenv("SERVICE_CREDENTIAL", secret)
    job = ws.run(ws.submit(f"Use the service (credential {secret}).", piece="single", model="demo"))
    text = ws.export_notebook(job, tmp_path / "c.ipynb").read_text(encoding="utf-8")
    assert secret not in text and MASK in text


# ---------------------------------------------------------------------------
# Item 4: the jail's /etc, capabilities, and commands that die with their worker


@pytest.mark.needs("bwrap")
def test_the_jail_shows_only_the_etc_commands_need(tmp_path: Path) -> None:
    require("bwrap")
    bash = get_tool("Bash")
    assert bash is not None
    # absent, not merely unreadable: root (as here and in CI) could read them, with or without capabilities
    hidden = bash.invoke(_ctx(tmp_path), {"command": (
        "for f in /etc/shadow /etc/gshadow /etc/sudoers /etc/sudoers.d /etc/ssh /etc/ssh/ssh_host_rsa_key; "
        "do test -e $f && echo READ $f; done; ls -A /etc/ssl/private 2>/dev/null | wc -l; "
        "grep CapEff /proc/self/status; mknod zero c 1 5 2>/dev/null && echo MADE; touch /etc/x 2>/dev/null "
        "&& echo WROTE; true")})
    assert not hidden.is_error, hidden.content
    assert "READ" not in hidden.content and "MADE" not in hidden.content and "WROTE" not in hidden.content
    assert hidden.content.splitlines()[0] == "0"  # the TLS private keys folder is empty
    assert "CapEff:\t0000000000000000" in hidden.content
    # ordinary commands still work
    work = bash.invoke(_ctx(tmp_path), {"command": (
        "set -e; ls / >/dev/null; id -un; cat /etc/passwd | head -1 | cut -d: -f1; python3 -c 'print(6*7)'; "
        "printf 'b\\na\\n' | sort | tr '\\n' ' '; echo; echo abc | grep b | sed s/b/B/ | awk '{print $1}'; "
        "date +%Y >/dev/null && echo dated; git init -q r && cd r && "
        "git -c user.name=a -c user.email=a@b commit -q --allow-empty -m first && git log --oneline | wc -l")})
    assert not work.is_error, work.content
    lines = work.content.splitlines()
    assert lines[0] == pwd.getpwuid(os.getuid()).pw_name  # users resolve by name
    assert lines[1] == "root" and lines[2:] == ["42", "a b ", "aBc", "dated", "1"], lines


_LOOP = 'while true; do echo x >> "{log}"; sleep 0.05; done'


@pytest.mark.parametrize("mode", ["off", JAIL])
@pytest.mark.parametrize("shape", ["loop", "background"])
def test_a_command_dies_with_its_worker(ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        mode: str, shape: str) -> None:
    _sandbox(mode, monkeypatch)
    command = _LOOP.format(log="output/fg.log")  # relative: the command runs in the work directory
    if shape == "background":  # a loop left running in the background by a command still running
        command = f"({_LOOP.format(log='output/bg.log')}) >/dev/null 2>&1 & {command}"
    job = ws.submit("loop", piece=str(_piece(tmp_path, ["Bash"])),
                    model=_script(tmp_path, [call("Bash", command=command, timeout=600)]))
    wd = Path(job.workdir)
    fg, bg = wd / "output" / "fg.log", wd / "output" / "bg.log"
    worker = subprocess.Popen([sys.executable, "-c", _RUN, str(ws.root), str(job.id)], env=_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        watched = [fg, bg] if shape == "background" else [fg]
        while not all(p.exists() and p.stat().st_size > 20 for p in watched):
            assert time.monotonic() < deadline, "the command never started"
            assert worker.poll() is None, "the worker ended early"
            time.sleep(0.05)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    try:
        time.sleep(1.0)
        sizes = [p.stat().st_size for p in watched]
        time.sleep(1.0)
        assert [p.stat().st_size for p in watched] == sizes, "a command kept running after its worker was killed"
    finally:
        _kill_processes_in(wd)


def _kill_processes_in(folder: Path) -> None:
    """Kill what still runs in ``folder`` (only if the test failed), so a regression leaves no loop behind."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(os.readlink(proc / "cwd")).is_relative_to(folder.resolve()):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            continue


def test_a_command_leaves_nothing_running_after_its_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTNB_BASH_SANDBOX", "off")
    bash = get_tool("Bash")
    assert bash is not None
    log = tmp_path / "bg.log"
    started = time.monotonic()
    out = bash.invoke(_ctx(tmp_path), {"command": f"({_LOOP.format(log=log)}) >/dev/null 2>&1 & echo started"})
    assert out.content == "started\n"
    timed = bash.invoke(_ctx(tmp_path), {"command": f"({_LOOP.format(log=log)}) >/dev/null 2>&1 & sleep 100",
                                         "timeout": 1})
    assert timed.is_error and "timed out after 1 s" in timed.content
    assert time.monotonic() - started < 30
    time.sleep(0.5)
    size = log.stat().st_size if log.exists() else 0
    time.sleep(0.8)
    assert (log.stat().st_size if log.exists() else 0) == size, "a background loop outlived its call"


# ---------------------------------------------------------------------------
# Item 6: special files


def _specials(wd: Path) -> bool:
    """Special files in ``input/``; True when a device node could be made too (root, not forbidden)."""
    (wd / "input" / "notes.md").write_text("alpha\nbeta needle\n")
    os.mkfifo(wd / "input" / "pipe")
    os.mkfifo(wd / "input" / "pipe.png")
    os.mkfifo(wd / "input" / "pipe.docx")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(wd / "input" / "sock"))
    sock.close()  # the socket file stays
    os.symlink("/dev/zero", wd / "input" / "zero")
    if os.geteuid() == 0:
        try:
            os.mknod(wd / "input" / "null-device", stat.S_IFCHR | 0o600, os.makedev(1, 3))
            return True
        except OSError:  # a container may forbid device nodes even to root
            pass
    return False


def test_special_files_are_refused_and_never_block(ws: Workspace, tmp_path: Path) -> None:
    calls = [
        call("Read", path="input/pipe"), call("Read", path="input/sock"), call("Read", path="input/zero"),
        call("Read", path="input/pipe.docx"), call("Grep", pattern="x", path="input/pipe"),
        call("Grep", pattern="needle"), call("Grep", pattern="needle", path="input"),
        call("ReadImage", path="input/pipe.png"), call("Glob", pattern="input/*"),
        call("Glob", pattern="input/pipe*"), call("Write", path="input/pipe", content="x"),
        call("Edit", path="input/pipe", old="a", new="b"), call("Read", path="output/made-by-bash"),
        call("Read", path="input/null-device"),
    ]
    job = ws.submit("special", piece=str(_piece(tmp_path, ["Read", "Grep", "Glob", "ReadImage", "Write", "Edit"],
                                                "edit")), model=_script(tmp_path, calls))
    wd = Path(job.workdir)
    device = _specials(wd)
    os.mkfifo(wd / "output" / "made-by-bash")
    assert _run_in_worker(ws, job, timeout=90) == "succeeded"
    r = [res["content"] for res in _results(ws, job)]
    errors = [res["is_error"] for res in _results(ws, job)]
    assert errors[:6] == [True, True, True, True, True, False]
    assert "'input/pipe' is a FIFO (named pipe), not a regular file" in r[0]
    assert "'input/sock' is a socket" in r[1]
    assert "leaves the work directory" in r[2]  # a link to /dev/zero never resolves inside
    assert "FIFO" in r[3] and "FIFO" in r[4]
    assert r[5] == "input/notes.md:2:beta needle" and r[6] == "input/notes.md:2:beta needle"  # skipped, not read
    assert errors[7] and "FIFO" in r[7]
    assert not errors[8] and "input/notes.md" in r[8] and "left out" in r[8] and "input/pipe (a FIFO" in r[8]
    assert "input/pipe\n" not in r[8] and "input/sock  (" not in r[8]
    assert errors[9] and "matches only special files" in r[9]
    assert errors[10] and "FIFO" in r[10] and errors[11] and "FIFO" in r[11]
    assert errors[12] and "FIFO" in r[12]
    assert errors[13] and ("'input/null-device' is a character device" if device else "no such file") in r[13]


@pytest.mark.parametrize("mode", [JAIL, "off"])
def test_a_fifo_made_by_bash_never_blocks_the_file_tools(ws: Workspace, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    _sandbox(mode, monkeypatch)
    calls = [call("Bash", command="mkfifo output/p && mkdir -p logs/checklists && mkfifo logs/checklists/todo.json "
                                  "logs/checklists/next.json.tmp && ls -l output"),
             call("Read", path="output/p"), call("Grep", pattern="x", path="output/p"), call("Grep", pattern="x"),
             call("Checklist", name="todo", items=[{"text": "a", "done": False}]),
             call("Checklist", name="next", items=[{"text": "b", "done": False}])]
    job = ws.submit("fifo", piece=str(_piece(tmp_path, ["Bash", "Read", "Grep", "Checklist"])),
                    model=_script(tmp_path, calls))
    assert _run_in_worker(ws, job, timeout=90, **({"AGENTNB_BASH_SANDBOX": "off"} if mode == "off" else {})) \
        == "succeeded"
    res = _results(ws, job)
    assert not res[0]["is_error"], res[0]["content"]
    assert res[1]["is_error"] and "FIFO" in res[1]["content"]
    assert res[2]["is_error"] and "FIFO" in res[2]["content"]
    assert res[3]["content"].startswith("No lines match")
    assert res[4]["is_error"] and "FIFO" in res[4]["content"]  # the checklist itself
    assert res[5]["is_error"] and "FIFO" in res[5]["content"]  # the file it is written to first


def test_fifos_planted_where_the_runner_keeps_lessons_and_checklists_never_block_it(
        ws: Workspace, tmp_path: Path) -> None:
    # The runner itself appends to logs/lessons.jsonl and reads logs/checklists/*.json for every prompt;
    # a command can leave FIFOs there (the work directory holds logs/), and opening one waited forever.
    piece = write_piece(tmp_path, "two", {"movements": [
        {"name": "a", "instruction": "A.", "tools": ["Read"], "rules": [{"next": "b"}]},
        {"name": "b", "instruction": "B.", "tools": ["Read"], "rules": [{"next": "COMPLETE"}]},
    ]})
    model = write_script(tmp_path, "two-script", {
        "a": [transition("b", summary="first", lessons="fifo lesson")],
        "b": [transition("COMPLETE", summary="second", lessons="second lesson")],
    })
    job = ws.submit("fifo logs", piece=str(piece), model=model)
    logs = ws.root / "jobs" / str(job.id) / "logs"
    (logs / "checklists").mkdir(parents=True, exist_ok=True)
    os.mkfifo(logs / "lessons.jsonl")
    os.mkfifo(logs / "checklists" / "x.json")
    (logs / "checklists" / "ok.json").write_text(json.dumps({"items": [{"text": "kept", "done": True}]}))
    assert _run_in_worker(ws, job, timeout=60) == "succeeded"
    assert [e.payload["lessons"] for e in ws.events(job, kinds=["lesson"])] == ["fifo lesson", "second lesson"]
    errors = [e.payload["message"] for e in ws.events(job, kinds=["error"])]
    assert len(errors) == 2 and all("lessons.jsonl" in m and "FIFO" in m for m in errors), errors
    assert str(ws.root) not in "".join(errors)
    second = [e.payload["user"] for e in ws.events(job, kinds=["movement_start"])][1]
    assert "[x] kept" in second and "x.json" not in second  # the regular checklist still reaches the prompt
    assert ws.frames.lessons(job).empty


def test_a_fifo_swapped_in_after_the_check_never_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The race a stat-then-open would lose: the check sees a regular file, the open meets a FIFO.
    fifo = tmp_path / "swapped.txt"
    os.mkfifo(fifo)
    real_lstat = os.lstat
    regular = real_lstat(__file__)

    def lstat(path: Any, *a: Any, **kw: Any) -> os.stat_result:
        return regular if os.fspath(path) == str(fifo) else real_lstat(path, *a, **kw)

    monkeypatch.setattr(os, "lstat", lstat)
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(get_tool("Read").invoke(  # type: ignore[union-attr]
        _ctx(tmp_path), {"path": "swapped.txt"})), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock it before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("Read blocked on a FIFO swapped in after the check")
    assert got[0].is_error and "FIFO" in got[0].content


# ---------------------------------------------------------------------------
# Item 7: catastrophic regexes


def test_a_catastrophic_pattern_is_stopped_with_a_hint(ws: Workspace, tmp_path: Path) -> None:
    calls = [call("Grep", pattern="(a+)+$", path="input/short.txt"),
             call("Grep", pattern="(a|aa)+$", path="input/long.txt"),
             call("Grep", pattern=r"(a|aa)+\1$", path="input/short.txt"),
             call("Grep", pattern=r"\bneedle\b"),
             call("Grep", pattern="needle")]
    job = ws.submit("regex", piece=str(_piece(tmp_path, ["Grep"], "readonly")), model=_script(tmp_path, calls),
                    inputs={"short.txt": "a" * 40 + "b\n", "long.txt": "a" * 30_000 + "b\n", "n.txt": "a needle\n"})
    started = time.monotonic()
    assert _run_in_worker(ws, job, timeout=60, AGENTNB_GREP_TIMEOUT="0.5") == "succeeded"
    assert time.monotonic() - started < 30
    res = _results(ws, job)
    # RE2 answers the hostile patterns it takes in linear time; a backreference is stopped at the limit
    for r in res[:2]:
        assert not r["is_error"] and r["content"].startswith("No lines match"), r["content"]
    assert res[2]["is_error"], res[2]["content"]
    assert "Grep: the pattern" in res[2]["content"] and "took longer than 0.5 s" in res[2]["content"]
    assert "simpler pattern" in res[2]["content"]
    assert res[3]["content"] == res[4]["content"] == "input/n.txt:1:a needle"


def test_grep_time_limit_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.txt").write_text("a" * 40 + "b\n")
    grep = get_tool("Grep")
    assert grep is not None
    started = time.monotonic()
    out = grep.invoke(_ctx(tmp_path, grep_timeout=0.2), {"pattern": r"(a|aa)+\1$"})
    assert out.is_error and "took longer than 0.2 s" in out.content
    assert time.monotonic() - started < 5
    monkeypatch.setenv("AGENTNB_GREP_TIMEOUT", "soon")
    out = grep.invoke(_ctx(tmp_path), {"pattern": "a"})
    assert out.is_error and "AGENTNB_GREP_TIMEOUT='soon'" in out.content and "seconds" in out.content


_BURN = "while True: pass"
_LIMIT = 0.5  # Grep's time limit in the tests below: every call must return within it plus 1 s

# each pattern backtracks for ages in a backtracking engine on some of these inputs; RE2 takes them all
_RE2_HOSTILE = [r"(a|a)+$", r"(a|aa)+$", r"(.*a){20}", r"((a+)+)+$", r"(a*)*$", r"(\w+\s?)+$", r"(x+x+)+y"]
# `regex` only (a backreference, a lookbehind, a Unicode \b): run in the search process, killed at the limit
_PROCESS_HOSTILE = [r"(a*)*\1$", r"(a|a)+\1$", r"(a|aa)+\1$", r"(a|a)+(?<!b)$", r"\b(a|a)+$"]


def _burners(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` processes that keep a core busy each (the machine a busy worker runs on)."""
    return [subprocess.Popen([sys.executable, "-c", _BURN]) for _ in range(n)]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (whichever of its threads started them)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to see the search processes")
def test_hostile_patterns_return_within_the_limit_on_a_busy_machine(tmp_path: Path) -> None:
    grep = get_tool("Grep")
    assert grep is not None
    for n in (30, 1_000, 10_000):
        (tmp_path / f"a{n}.txt").write_text("a" * n + "b\n" + "xxx" * (n // 3) + "\n")
    ctx = _ctx(tmp_path, grep_timeout=_LIMIT)
    burners = _burners(3)
    slow: list[str] = []
    try:
        for pattern in _RE2_HOSTILE + _PROCESS_HOSTILE:
            for n in (30, 1_000, 10_000):
                started = time.monotonic()
                out = grep.invoke(ctx, {"pattern": pattern, "path": f"a{n}.txt"})
                took = time.monotonic() - started
                if took > _LIMIT + 1:
                    slow.append(f"{pattern} on {n} characters: {took:.1f} s")
                if pattern in _RE2_HOSTILE:  # answered, not stopped
                    assert not out.is_error, (pattern, n, out.content)
                elif out.is_error:
                    assert out.content.startswith(f"Error: Grep: the pattern {pattern!r} took longer than 0.5 s"), \
                        out.content
                    assert "simpler pattern" in out.content
        # the answers are right, not only quick
        assert grep.invoke(ctx, {"pattern": "(a|aa)+$", "path": "a30.txt"}).content.startswith("No lines match")
        assert grep.invoke(ctx, {"pattern": "(x+x+)+$", "path": "a30.txt"}).content == "a30.txt:2:" + "x" * 30
        out = grep.invoke(ctx, {"pattern": r"(a|a)+\1$", "path": "a30.txt"})
        assert out.is_error and "took longer than 0.5 s" in out.content
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert not slow, "Grep calls past the limit + 1 s:\n" + "\n".join(slow)
    # a search process killed at the limit was reaped: none is left a zombie
    assert [c for c in _children(os.getpid()) if _state(c) == "Z"] == []


def test_python_only_patterns_run_from_many_threads_at_once(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("abab x\nfoo foo\nnaïve café\n" * 50)
    grep = get_tool("Grep")
    assert grep is not None
    want = {r"(ab)\1": "abab", r"(\w+) \1": "foo foo", r"\bcafé\b": "café", r"(?<=naïve )caf": "café"}
    got: dict[str, list[str]] = {p: [] for p in want}

    def run(pattern: str) -> None:
        for _ in range(5):
            got[pattern].append(grep.invoke(_ctx(tmp_path), {"pattern": pattern}).content)  # type: ignore[union-attr]

    threads = [threading.Thread(target=run, args=(p,)) for p in want for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for pattern, text in want.items():
        assert len(got[pattern]) == 10
        for content in got[pattern]:
            lines = content.split("\n")
            assert len(lines) == 50 and all(text in line for line in lines), content[:300]


_KILL_PARENT = """
import sys, threading
from pathlib import Path
from agentnb.tools.base import ToolContext, get_tool
ctx = ToolContext(workdir=Path(sys.argv[1]), logs_dir=Path(sys.argv[1]) / "logs", grep_timeout=600)
threading.Thread(target=get_tool("Grep").invoke, args=(ctx, {"pattern": r"(a|a)+\\1$"})).start()
print("started", flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to see the search processes")
def test_a_search_process_dies_with_its_parent(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a" * 40 + "b\n")
    parent = subprocess.Popen([sys.executable, "-c", _KILL_PARENT, str(tmp_path)], env=_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 20
        while not (searchers := _children(parent.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert searchers, "no search process was started"
        time.sleep(0.3)  # it is matching now
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5
    while any(_state(p) not in (None, "Z") for p in searchers) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [p for p in searchers if _state(p) not in (None, "Z")]
    for p in alive:
        with suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    assert not alive, "the search process outlived its parent"


_SAME_TEXT = ("naïve café 42 ٣٤\tÉcole\u00a0x\x0bv\n"
              "snake_case and CamelCase, a{,2}b aab\n"
              "Straße STRASSE ǅ ǆ σς Σ Kelvin \u212a k\n"
              "plain ascii line with 123 and foo.bar\n"
              "[brackets] -dash- back\\slash $dollar ^caret\n"
              "٣٤ école\u3000ok\n")
_ORDINARY = [r"\w+é", r"\d+", r"\s\w", r"\W\d", r"[\w.]+", r"[^\W\d]+", r"[\d\s]+\w", r"\S+\s", r"(?i)straße",
             r"(?i)k", r"(?i)[a-c]+\b", r"a{,2}b", r"[[:alpha:]]+", r"\bcaf", r"é\b", r"^\w+$", r"x\Z", r"\D{3}",
             r"(?P<w>foo)\.bar", r"[]\[]", r"\$\w+", r"\\s", r"(?i)\W", r"(?i)[\W]", r"Σ|ς", r"caf(?=é)",
             r"^\d+ \w+\s", r"^\S+\s\w+$", r"[\D]{3}\s"]


def test_ordinary_patterns_match_as_python_regex_does(tmp_path: Path) -> None:
    import regex

    (tmp_path / "t.txt").write_text(_SAME_TEXT)
    grep = get_tool("Grep")
    assert grep is not None
    lines = _SAME_TEXT.split("\n")[:-1]
    for pattern in _ORDINARY:
        want = [f"t.txt:{n}:{line}" for n, line in enumerate(lines, 1) if regex.search(pattern, line)]
        out = grep.invoke(_ctx(tmp_path), {"pattern": pattern})
        assert not out.is_error, out.content
        got = [] if out.content.startswith("No lines match") else out.content.split("\n")
        assert got == want, pattern


def test_both_engines_show_the_same_output(tmp_path: Path) -> None:
    # long lines cut around the match, the output budget, the count of matches: one format whichever engine ran
    (tmp_path / "big.txt").write_text("".join(
        ("x" * (i * 7 % 1500) + " foo " + "y" * (i * 13 % 900) if i % 3 == 0 else "nothing here") + "\n"
        for i in range(3000)))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "s.txt").write_text("foo\n" * 10 + "bar\n")
    grep = get_tool("Grep")
    assert grep is not None
    for budget in (500, 20_000, 200_000):
        ctx = _ctx(tmp_path, budget_tokens=budget)
        re2_out = grep.invoke(ctx, {"pattern": "foo|bar"})
        regex_out = grep.invoke(ctx, {"pattern": r"(?<=\s)foo\b|(?<=^)foo|bar"})  # lookbehinds: not RE2
        assert re2_out.content == regex_out.content
        assert (re2_out.truncated, re2_out.original_chars) == (regex_out.truncated, regex_out.original_chars)
        if budget == 500:
            assert "(1,011 matching lines in all.)" in re2_out.content
