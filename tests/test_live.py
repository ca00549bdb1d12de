"""The in-process subscription (agentnb.live): each event of a job as its transaction commits, in commit order,
nothing for a rollback, on both stores, from many threads, with notices from the engine; a raising subscriber
never breaks the run."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, transition, write_piece, write_script

import agentnb
from agentnb import Workspace, live
from agentnb.events import CommentEvent, Event, LLMRequest, LLMResponse
from agentnb.live import Notice
from agentnb.store import Store, open_store

SHAPED_KEY = "sk-proj-" + "Tq4vW9" * 7  # key-shaped text: the store scrubs it, so the published event has none


def _piece(tmp_path: Path) -> Path:
    return write_piece(tmp_path, "work", {"max_movements": 3, "movements": [{
        "name": "work", "persona": "You work.", "instruction": "Do it.", "tools": ["Glob"], "permission": "readonly",
        "rules": [{"condition": "done", "next": "COMPLETE"}]}]})


def _script(tmp_path: Path) -> str:
    return write_script(tmp_path, "script", {"work": [
        {"content": f"looking ({SHAPED_KEY})", "tool_calls": [{"name": "Glob", "arguments": {"pattern": "*"}}]},
        call("Glob", pattern="*.md"),
        transition("COMPLETE"),
    ]})


class Received:
    """A subscriber that keeps what it is given, and checks each event is committed when it arrives: another
    connection to the store (``reader``) already reads it."""

    def __init__(self, reader: Store | None = None) -> None:
        self.items: list[live.Item] = []
        self.reader = reader
        self.unseen: list[int] = []  # events that another connection could not read yet when they arrived
        self.lock = threading.Lock()

    def __call__(self, item: live.Item) -> None:
        if self.reader is not None and isinstance(item, Event):
            assert item.id is not None
            if item.id not in {e.id for e in self.reader.events(item.job_id, after_id=item.id - 1)}:
                self.unseen.append(item.id)
        with self.lock:
            self.items.append(item)

    @property
    def events(self) -> list[Event]:
        return [i for i in self.items if not isinstance(i, Notice)]

    @property
    def notices(self) -> list[Notice]:
        return [i for i in self.items if isinstance(i, Notice)]


def test_a_subscriber_gets_each_event_of_its_job_as_it_commits(tmp_path: Path, store_url: str) -> None:
    with Workspace(tmp_path / "ws", store=store_url) as ws:
        job = ws.submit("x" * 5000, piece=_piece(tmp_path), model=_script(tmp_path))  # a long one: stored by reference
        other = ws.submit("another", piece=_piece(tmp_path), model=_script(tmp_path))
        reader = open_store(store_url)
        got, elsewhere = Received(reader), Received()
        try:
            with live.subscribe(ws.store, job.id, got), live.subscribe(ws.store, other.id, elsewhere):
                ws.run(job)
            ws.run(other)  # after the subscription ended: nothing more arrives
        finally:
            reader.close()
        stored = ws.events(job)
        # every event after the subscription began, exactly as the store reads it back (ids, payloads scrubbed of
        # the key, the long instruction put back in movement_start), in commit order, each committed on arrival
        assert got.events == stored[1:]  # the first, "submitted", was committed before
        assert [e.kind for e in got.events][:3] == ["job_status", "movement_start", "llm_request"]
        assert "x" * 5000 in got.events[1].user  # type: ignore[union-attr]
        assert SHAPED_KEY not in repr(got.events) and got.unseen == []
        assert elsewhere.items == []
        # a notice before each call the model is asked, after its llm_request and before its response
        calls = [e for e in stored if isinstance(e, LLMRequest)]
        assert [(n.what, n.movement_seq, n.iteration) for n in got.notices] == [
            ("call_started", e.movement_seq, e.iteration) for e in calls]
        order = [(i.what if isinstance(i, Notice) else i.kind) for i in got.items]
        for n in range(len(calls)):
            start = order.index("call_started", order.index("call_started") + n if n else 0)
            assert order[start - 1] == "llm_request" and order[start + 1] == "llm_response"


def test_a_rolled_back_transaction_publishes_nothing(tmp_path: Path, store_url: str) -> None:
    store = open_store(store_url)
    try:
        job_id = store.create_job(piece="p", piece_yaml="name: p", model="demo", instruction="t", workdir="")
        got = Received()
        with live.subscribe(store, job_id, got):
            with pytest.raises(RuntimeError), store.transaction() as c:
                store.append([CommentEvent(job_id=job_id, author="user", body="undone")], c)
                with store.transaction() as inner:  # a nested one is part of the outer: undone with it
                    store.append([CommentEvent(job_id=job_id, author="user", body="undone too")], inner)
                raise RuntimeError("rolled back")
            assert got.items == []
            store.append([CommentEvent(job_id=job_id, author="user", body="kept")])
            with store.transaction() as c:
                store.add_comment(c, job_id, "user", "kept too")
                store.set_status(c, job_id, "aborted", "by the test")
                assert len(got.items) == 1  # "kept"; the two of this transaction not before its commit
        assert [getattr(e, "body", getattr(e, "status", None)) for e in got.events] == ["kept", "kept too", "aborted"]
        assert got.events == store.events(job_id)[1:]
    finally:
        store.close()


def test_events_from_many_threads_arrive_in_commit_order(tmp_path: Path, store_url: str) -> None:
    store = open_store(store_url)
    try:
        jobs = [store.create_job(piece="p", piece_yaml="name: p", model="demo", instruction=f"t{n}", workdir="")
                for n in range(4)]
        every, first = Received(), Received()
        errors: list[BaseException] = []

        def write(job_id: int, twice: bool) -> None:
            try:
                for n in range(40):
                    with store.transaction() as c:  # one job's appends commit in id order (they lock its row)
                        store.append([CommentEvent(job_id=job_id, author="t", body=f"{n}"),
                                      CommentEvent(job_id=job_id, author="t", body=f"{n}b")], c)
                    if twice:
                        store.append([CommentEvent(job_id=jobs[0], author="t2", body=f"{n}")])
            except BaseException as exc:
                errors.append(exc)

        with live.subscribe(store, None, every), live.subscribe(store, jobs[0], first):
            threads = [threading.Thread(target=write, args=(j, j != jobs[0])) for j in jobs]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        assert errors == []
        for job_id in jobs:
            mine = [e for e in every.events if e.job_id == job_id]
            assert mine == store.events(job_id)[1:]  # all of them, each once, in the order they committed
        assert first.events == [e for e in every.events if e.job_id == jobs[0]]
        assert len(first.events) == 80 + 3 * 40
    finally:
        store.close()


def test_a_raising_subscriber_is_logged_once_and_the_run_goes_on(tmp_path: Path, store_url: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    def broken(item: Any) -> None:
        raise ValueError("a broken subscriber")

    with Workspace(tmp_path / "ws", store=store_url) as ws:
        job = ws.submit("t", piece=_piece(tmp_path), model=_script(tmp_path))
        got = Received()
        with caplog.at_level(logging.ERROR, logger="agentnb.live"), live.subscribe(ws.store, job.id, broken), \
                live.subscribe(ws.store, job.id, got):
            ws.run(job)
        assert ws.job(job).status == "succeeded"
        assert got.events == ws.events(job)[1:]  # the one after it was given every event too
        logged = [r for r in caplog.records if r.name == "agentnb.live"]
        assert len(logged) == 1 and "a live subscriber" in logged[0].getMessage()
        assert "a broken subscriber" in (logged[0].exc_text or "")


def test_a_channel_is_the_store_not_the_object(tmp_path: Path) -> None:
    # two Store objects on one file are one channel (a second Workspace on the folder, a worker in the kernel);
    # another file is another, though its job ids are the same
    path, elsewhere = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    first, second, third = open_store(path), open_store(path), open_store(elsewhere)
    try:
        job_id = first.create_job(piece="p", piece_yaml="name: p", model="demo", instruction="t", workdir="")
        assert third.create_job(piece="p", piece_yaml="name: p", model="demo", instruction="t", workdir="") == job_id
        got = Received()
        with live.subscribe(first, job_id, got):
            second.append([CommentEvent(job_id=job_id, author="user", body="same file")])
            third.append([CommentEvent(job_id=job_id, author="user", body="other file")])
        assert [e.body for e in got.events] == ["same file"]  # type: ignore[union-attr]
        assert not live.wants(first, [job_id])  # closed: the stores collect nothing any more
    finally:
        for s in (first, second, third):
            s.close()


def test_only_events_of_a_watched_job_are_collected(tmp_path: Path) -> None:
    # the stores ask live.wants before collecting a transaction's events: a subscriber of another job (or none)
    # costs an unwatched job's commits nothing but that test
    store = open_store(tmp_path / "s.sqlite")
    try:
        a = store.create_job(piece="p", piece_yaml="name: p", model="demo", instruction="a", workdir="")
        b = store.create_job(piece="p", piece_yaml="name: p", model="demo", instruction="b", workdir="")
        assert not live.wants(store, [a, b])
        with live.subscribe(store, b, Received()):
            assert live.wants(store, [a, b]) and not live.wants(store, [a])
        with live.subscribe(store, None, Received()):
            assert live.wants(store, [a])
        assert not live.wants(store, [a, b])
    finally:
        store.close()


def test_the_execution_subscribes_to_the_typed_events_of_its_jobs(tmp_path: Path) -> None:
    # ws.execution.subscribe is the bus's door on the object that runs the job; what a subscriber gets is the
    # typed event, nested values included (a view folds it without the store)
    with Workspace(tmp_path / "ws") as ws:
        job = ws.submit("t", piece=_piece(tmp_path), model=_script(tmp_path))
        got = Received()
        with ws.execution.subscribe(job.id, got):
            ws.run(job)
        assert got.events == ws.events(job)[1:]
        responses = [e for e in got.events if isinstance(e, LLMResponse)]
        assert len(responses) == 3 and all(r.usage.total_tokens > 0 for r in responses)
        assert responses[0].tool_calls[0].name == "Glob"


def test_the_live_view_redraws_what_its_run_committed_before_it_began_to_watch(tmp_path: Path) -> None:
    # The magic starts the run, then watches: a run quick to reach a slow tool has committed its first calls
    # before the watch begins, and the view must show them then, not only at the next commit (seen under load:
    # the view stayed on its first drawing while the job waited in a tool)
    from agentnb.notebook.liveview import LiveView
    from agentnb.tools.base import unregister

    entered, gate = threading.Event(), threading.Event()

    @agentnb.tool(name="TestLiveGate")
    def live_gate() -> str:
        """Wait for the test."""
        entered.set()
        return "opened" if gate.wait(60) else "timed out"

    try:
        piece = write_piece(tmp_path, "gated", {"movements": [{
            "name": "work", "persona": "p", "instruction": "i", "tools": ["TestLiveGate"],
            "rules": [{"condition": "done", "next": "COMPLETE"}]}]})
        script = write_script(tmp_path, "gated-script", {"work": [call("TestLiveGate"), transition("COMPLETE")]})
        with Workspace(tmp_path / "ws") as ws:
            job = ws.submit("t", piece=piece, model=script)
            view = LiveView(ws.execution)
            view.start(lambda: ws.run(job.id), job.id)
            assert entered.wait(60)  # the call and its tool call are committed; nothing more until the gate opens
            drawn: list[int] = []
            watcher = threading.Thread(target=view.watch, args=(drawn.append,))
            watcher.start()
            try:
                deadline = time.monotonic() + 10
                while not drawn and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert drawn == [ws.store.last_event_id(job.id)]  # drawn at once, before any further commit
            finally:
                gate.set()
                watcher.join(60)
                view.close()
            assert view.failure is None and drawn[-1] == ws.store.last_event_id(job.id)
            assert ws.job(job.id).status == "succeeded"
    finally:
        gate.set()
        unregister("TestLiveGate")


def test_a_subscription_to_some_kinds_gets_only_those_events_and_no_notices(tmp_path: Path) -> None:
    with Workspace(tmp_path / "ws") as ws:
        picky, every = Received(), Received()
        job = ws.submit("go", piece=str(_piece(tmp_path)), model=_script(tmp_path))
        with live.subscribe(ws.store, None, picky, kinds=("transition", "job_status")), \
                ws.execution.subscribe(job.id, every):
            assert ws.run(job).status == "succeeded"
        assert [e.kind for e in picky.items] == [e.kind for e in every.events if e.kind in ("transition", "job_status")]
        assert {e.kind for e in picky.items} == {"transition", "job_status"}
        assert any(isinstance(i, Notice) for i in every.items)  # the engine's call_started: not for kinds=
        with pytest.raises(ValueError, match="every job"):
            live.subscribe(ws.store, job.id, picky, kinds=("transition",))


def test_subscriptions_to_different_kinds_come_and_go_each_with_its_own_kinds(tmp_path: Path) -> None:
    # the stores let a transaction go at one test of the kinds anyone wants: that set follows every subscribe/close
    with Workspace(tmp_path / "ws") as ws:
        piece, model = str(_piece(tmp_path)), _script(tmp_path)
        ends, answers, tools = Received(), Received(), Received()
        first = ws.submit("one", piece=piece, model=model)
        with live.subscribe(ws.store, None, ends, kinds=("transition",)):
            answer_sub = live.subscribe(ws.store, None, answers, kinds=("llm_response",))
            assert ws.run(first).status == "succeeded"
            answer_sub.close()
            second = ws.submit("two", piece=piece, model=model)
            assert ws.run(second).status == "succeeded"
        third = ws.submit("three", piece=piece, model=model)
        with live.subscribe(ws.store, None, tools, kinds=("tool_result",)):
            assert ws.run(third).status == "succeeded"
        assert [(e.kind, e.job_id) for e in ends.items] == [("transition", first.id), ("transition", second.id)]
        stored = [e.id for e in ws.events(first, kinds=["llm_response"])]
        assert stored and [e.id for e in answers.items] == stored  # the first job's answers only: closed before
        assert {e.kind for e in tools.items} == {"tool_result"} and {e.job_id for e in tools.items} == {third.id}
