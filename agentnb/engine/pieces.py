"""Pieces: workflows of movements, loaded from YAML and validated.

A bad piece never reaches the runner: :class:`PieceError` names the file, the
line, the field, what was found and what is allowed.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import Node, ScalarNode, SequenceNode

from ..errors import PieceError
from ..tools.mcp import McpServer
from ._piece_check import TOP, Checker, FastLoader, Keys, keys_found, yaml_error, yaml_field
from .piece_mcp import check_mcp_tool, mcp_servers

__all__ = [
    "COMPACTION_DEFAULTS",
    "DEFAULT_THRESHOLDS",
    "LOOP_NEXT",
    "ON_PRESSURE",
    "PERMISSIONS",
    "SPECIAL_NEXT",
    "LoopMonitor",
    "Movement",
    "Piece",
    "PieceError",
    "Rule",
    "available_pieces",
    "load_piece",
    "parse_piece",
    "piece_search_path",
]

SPECIAL_NEXT = ("COMPLETE", "ASK", "ABORT", "WAIT_SUBTASKS")
PERMISSIONS = ("readonly", "edit", "full")
LANGUAGES = ("en", "ja")
# where a loop monitor (its judge's rules or its `next`) may send a job besides a movement: ASK needs a
# question and WAIT_SUBTASKS subtasks, which neither a monitor nor a tool-less judge has
LOOP_NEXT = ("COMPLETE", "ABORT")
JUDGE_MAX_ITERATIONS = 5
DEFAULT_THRESHOLDS: dict[str, float] = {"warn": 0.70, "prompt": 0.85, "force_transition": 0.95, "exhausted": 0.99}
# what a movement does when its context crosses the prompt threshold (docs/context.md): the seed's wrap-up reminder
# and forced transition, or summarise the conversation so far and go on
ON_PRESSURE = ("transition", "compact")
COMPACTION_DEFAULTS: dict[str, Any] = {"on_pressure": "transition", "compact_keep_last": 4, "max_compactions": 2}
PACKAGE_PIECES = Path(__file__).resolve().parents[1] / "pieces"
_YAML_TEXTS: dict[str, str] = {}  # Piece.to_yaml's texts by their dict's repr


@dataclass(frozen=True)
class Rule:
    condition: str
    next: str


@dataclass(frozen=True)
class Movement:
    name: str
    persona: str = ""
    instruction: str = ""
    tools: tuple[str, ...] = ()
    permission: str = "readonly"
    max_iterations: int = 20
    rules: tuple[Rule, ...] = ()
    default_next: str | None = None
    verify: str | None = None
    description: str = ""
    # the movement's own `context:` (docs/context.md#compaction): on_pressure, compact_keep_last, max_compactions; None
    # takes the piece's
    on_pressure: str | None = None
    compact_keep_last: int | None = None
    max_compactions: int | None = None

    @property
    def next_steps(self) -> tuple[str, ...]:
        """Every value ``transition.next_step`` may take in this movement: its rule targets, then ABORT.

        docs/pieces.md has the model choose "one of the movement's rule targets", so COMPLETE, ASK and
        WAIT_SUBTASKS are open only where a rule names them (a plan step cannot skip to COMPLETE, and only a
        movement that says so creates child jobs).  ABORT is always open: a task that cannot be done must be
        able to stop, as the seed's force_transition falls back to it.  The prompt, the reminder, the
        transition tool's schema and its validation all read this one tuple.
        """
        seen: dict[str, None] = {r.next: None for r in self.rules}
        seen.setdefault("ABORT", None)
        return tuple(seen)


@dataclass(frozen=True)
class LoopMonitor:
    """``loop_monitors[i]`` (docs/context.md#loop-monitors): when the runs end with ``cycle`` repeated ``threshold`` times (counted
    since this monitor's last judgement), ``judge`` — a tool-less movement named ``name`` — decides the next
    step, or without a judge the job goes to ``next``."""

    name: str
    cycle: tuple[str, ...]
    threshold: int
    judge: Movement | None = None
    next: str | None = None


@dataclass(frozen=True)
class Piece:
    name: str
    movements: tuple[Movement, ...]
    description: str = ""
    initial_movement: str = ""
    max_movements: int = 12
    language: str = "en"
    window_tokens: int | None = None
    thresholds: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    min_tool_tokens: int | None = None
    source: str = "<piece>"
    loop_monitors: tuple[LoopMonitor, ...] = ()
    on_pressure: str = "transition"
    compact_keep_last: int = 4
    max_compactions: int = 2
    mcp_servers: dict[str, McpServer] = field(default_factory=dict)  # docs/pieces.md#mcp-servers
    cost_limit: float | None = None  # US dollars per job with its subtasks (docs/design-lab.md#budgets)
    token_limit: int | None = None

    def movement(self, name: str) -> Movement:
        """Movement ``name``, or the judge of the loop monitor of that name (a judge's run is a movement run)."""
        for m in self.movements:
            if m.name == name:
                return m
        for lm in self.loop_monitors:
            if lm.judge is not None and lm.judge.name == name:
                return lm.judge
        raise KeyError(f"piece {self.name!r} has no movement {name!r}; movements: {', '.join(self.names)}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.movements)

    @property
    def run_names(self) -> tuple[str, ...]:
        """Every name a movement run of this piece may have: its movements, then its loop monitors' judges."""
        return self.names + tuple(lm.judge.name for lm in self.loop_monitors if lm.judge is not None)

    def to_dict(self) -> dict[str, Any]:
        """A plain structure that :func:`parse_piece` reads back to an equal piece (files inlined)."""
        ctx: dict[str, Any] = {"thresholds": dict(self.thresholds)}
        if self.window_tokens:
            ctx["window_tokens"] = self.window_tokens
        if self.min_tool_tokens:
            ctx["min_tool_tokens"] = self.min_tool_tokens
        # only when not the default: the stored YAML of a piece that does not use compaction is unchanged
        for key, default in COMPACTION_DEFAULTS.items():
            if getattr(self, key) != default:
                ctx[key] = getattr(self, key)
        out: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "initial_movement": self.initial_movement,
            "max_movements": self.max_movements,
            "language": self.language,
            "context": ctx,
            "movements": [],
        }
        for m in self.movements:
            d: dict[str, Any] = {
                "name": m.name,
                "persona": m.persona,
                "instruction": m.instruction,
                "tools": list(m.tools),
                "permission": m.permission,
                "max_iterations": m.max_iterations,
                "rules": [{"condition": r.condition, "next": r.next} if r.condition else {"next": r.next}
                          for r in m.rules],
            }
            if m.description:
                d["description"] = m.description
            if m.default_next:
                d["default_next"] = m.default_next
            if m.verify:
                d["verify"] = m.verify
            mctx = {k: getattr(m, k) for k in COMPACTION_DEFAULTS if getattr(m, k) is not None}
            if mctx:
                d["context"] = mctx
            out["movements"].append(d)
        if self.loop_monitors:  # only when present: the stored YAML of a piece without monitors is unchanged
            out["loop_monitors"] = [_monitor_dict(lm) for lm in self.loop_monitors]
        if self.mcp_servers:  # likewise
            out["mcp_servers"] = {name: s.to_dict() for name, s in self.mcp_servers.items()}
        out.update({k: getattr(self, k) for k in ("cost_limit", "token_limit") if getattr(self, k) is not None})
        return out

    def to_yaml(self) -> str:
        data = self.to_dict()
        # PyYAML's emitter takes ~0.5 ms for a small piece, and a batch's submission writes the same piece into
        # every job: the text is kept by the dict's repr (cheap, and it tells 1 from "1"), not by the Piece,
        # whose lists a caller could change in place
        key = repr(data)
        text = _YAML_TEXTS.get(key)
        if text is None:
            text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
            if len(_YAML_TEXTS) >= 64:
                _YAML_TEXTS.clear()
            _YAML_TEXTS[key] = text
        return text

    def replace_movement(self, name: str, /, **changes: Any) -> Piece:
        """A copy of this piece with movement ``name`` changed, checked like a piece file (docs/fork-compare.md).

        ``changes`` are movement keys of the YAML: ``persona``, ``instruction``, ``tools`` (names),
        ``permission``, ``max_iterations``, ``rules`` (``Rule``s, or mappings with ``condition`` and
        ``next``), ``default_next``, ``verify``, ``description``; None removes an optional one.  For
        example ``ws.fork(job, at=2, piece=piece.replace_movement("implement", instruction="…"))``.
        """
        allowed = [k for k in _MOVEMENT_KEYS if k not in ("name", "persona_file", "instruction_file")]
        unknown = sorted(set(changes) - set(allowed))
        if unknown:
            raise PieceError(f"replace_movement: unknown key(s) {unknown}; allowed: {', '.join(allowed)} "
                             "(a movement keeps its name, which other movements' rules refer to)", file=self.source)
        if name not in self.names:
            raise PieceError(f"replace_movement: no movement {name!r}; movements: {', '.join(self.names)}",
                             file=self.source)
        data = self.to_dict()
        mv = next(m for m in data["movements"] if m["name"] == name)
        for key, value in changes.items():
            if key == "rules" and value is not None:
                value = [{"condition": r.condition, "next": r.next} if isinstance(r, Rule) else r for r in value]
            elif key == "tools" and value is not None and not isinstance(value, str):
                value = list(value)
            if value is None:
                mv.pop(key, None)
            else:
                mv[key] = value
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
        return parse_piece(text, source=f"{self.source} (movement {name} replaced)")

    def with_mcp_server(self, name: str, /, **settings: Any) -> Piece:
        """A copy with MCP server ``name`` declared (or replaced), checked like a piece file: ``settings`` are the
        keys of ``mcp_servers.<name>`` (docs/pieces.md#mcp-servers); a movement then names its tools
        (``replace_movement(m, tools=[..., f"{name}.*"])``)."""
        data = self.to_dict()
        data.setdefault("mcp_servers", {})[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
        return parse_piece(text, source=f"{self.source} (MCP server {name} declared)")


def _monitor_dict(lm: LoopMonitor) -> dict[str, Any]:
    d: dict[str, Any] = {"name": lm.name, "cycle": list(lm.cycle), "threshold": lm.threshold}
    if lm.judge is not None:
        d["judge"] = {"persona": lm.judge.persona, "instruction": lm.judge.instruction,
                      "rules": [{"condition": r.condition, "next": r.next} if r.condition else {"next": r.next}
                                for r in lm.judge.rules]}
    else:
        d["next"] = lm.next
    return d


# ---------------------------------------------------------------------------
# Validation over YAML nodes, so every error knows its line.

_TOP_KEYS = ("name", "description", "initial_movement", "max_movements", "language", "context", "movements",
             "loop_monitors", "mcp_servers", "cost_limit", "token_limit")
_MONITOR_KEYS = ("name", "cycle", "threshold", "judge", "next")
_JUDGE_KEYS = ("persona", "instruction", "rules")
_JUDGE_PERSONA = "You judge whether a loop of movements in an agent workflow is making progress."
_JUDGE_INSTRUCTION = ("The movements below have repeated as a loop. Look at the summaries of the last rounds and "
                      "decide whether the work is converging.")
_CONTEXT_KEYS = ("window_tokens", "thresholds", "min_tool_tokens", *COMPACTION_DEFAULTS)
_MOVEMENT_CONTEXT_KEYS = tuple(COMPACTION_DEFAULTS)
_MOVEMENT_KEYS = (
    "name", "description", "persona", "persona_file", "instruction", "instruction_file", "tools",
    "permission", "max_iterations", "rules", "default_next", "verify", "context",
)
_RULE_KEYS = ("condition", "next")
def parse_piece(
    text: str,
    *,
    source: str = "<piece>",
    base_dir: str | os.PathLike[str] | None = None,
    known_tools: Iterable[str] | None = None,
) -> Piece:
    """Parse and validate piece YAML text.

    ``known_tools``: tool names a movement may list; ``None`` takes the
    registered tools (built-ins and ``@agentnb.tool`` functions).

    Checked in reading order (the top keys, ``context``, each movement, then the names that movements
    refer to), so the first mistake in the file is the one reported.
    """
    ck = Checker(source, Path(base_dir) if base_dir else None)
    root = _compose(text, source)
    top = ck.mapping(root, TOP, _TOP_KEYS)
    for required in ("name", "movements"):
        if required not in top:
            raise ck.fail(root, required, f"missing required key {required!r}; found keys: {keys_found(top)}")
    if known_tools is None:
        from ..tools.base import registered_tool_names

        known_tools = registered_tool_names()
    known = tuple(known_tools)

    name = ck.string(top["name"][1], "name")
    description = ck.optional(top, "description", "", lambda n, f: ck.string(n, f, nonempty=False))
    max_movements = ck.optional(top, "max_movements", 12, ck.integer)
    language = ck.optional(top, "language", "en", lambda n, f: ck.string(n, f, choices=LANGUAGES))
    window, min_tool, thresholds, compaction = _context(ck, top)
    cost_limit = ck.optional(top, "cost_limit", None, lambda n, f: _limit(ck, n, f))
    token_limit = ck.optional(top, "token_limit", None, ck.integer)

    mnodes = ck.sequence(top["movements"][1], "movements")
    if not mnodes:
        raise ck.fail(top["movements"][1], "movements", "found an empty list, expected at least one movement")
    seen: dict[str, int] = {}  # movement name → the line it is defined on
    servers = mcp_servers(ck, top["mcp_servers"][1]) if "mcp_servers" in top else {}
    parsed = [_movement(ck, i, mnode, known, seen, servers) for i, mnode in enumerate(mnodes)]
    names = tuple(m.name for m, _, _ in parsed)
    for movement, keys, fld in parsed:
        _check_next_steps(ck, movement, keys, fld, names)

    initial = names[0]
    if "initial_movement" in top:
        node = top["initial_movement"][1]
        initial = ck.string(node, "initial_movement")
        ck.one_of(node, "initial_movement", initial, names)

    monitors = _loop_monitors(ck, top["loop_monitors"][1], names) if "loop_monitors" in top else ()

    return Piece(
        name=name, movements=tuple(m for m, _, _ in parsed), description=description, initial_movement=initial,
        max_movements=max_movements, language=language, window_tokens=window, thresholds=thresholds,
        min_tool_tokens=min_tool, source=source, loop_monitors=monitors, mcp_servers=servers, **compaction,
        cost_limit=cost_limit, token_limit=token_limit,
    )


def _limit(ck: Checker, node: Node, fld: str) -> float:
    """``cost_limit``: US dollars > 0 (docs/design-lab.md#budgets)."""
    tags = ("tag:yaml.org,2002:float", "tag:yaml.org,2002:int")
    value = yaml.load(node.value, Loader=FastLoader) if isinstance(node, ScalarNode) and node.tag in tags else None
    if value is None or not 0 < value < float("inf"):
        found = (repr(value) if value is not None else repr(node.value) if isinstance(node, ScalarNode)
                 else "a list" if isinstance(node, SequenceNode) else "a mapping")
        raise ck.fail(node, fld, f"found {found}, expected a number of US dollars > 0")
    return float(value)


def _loop_monitors(ck: Checker, node: Node, names: tuple[str, ...]) -> tuple[LoopMonitor, ...]:
    """``loop_monitors:`` (docs/context.md#loop-monitors): each a cycle of existing movements, a threshold ≥ 1 and exactly one of
    ``judge`` (a tool-less movement run named after the monitor) and ``next``."""
    if isinstance(node, ScalarNode) and node.value == "":
        return ()
    targets = names + LOOP_NEXT
    monitors: list[LoopMonitor] = []
    taken: dict[str, int] = {}  # monitor names → their line (a judge's run is named after its monitor)
    for i, mnode in enumerate(ck.sequence(node, "loop_monitors")):
        fld = f"loop_monitors[{i}]"
        keys = ck.mapping(mnode, fld, _MONITOR_KEYS)
        for required in ("cycle", "threshold"):
            if required not in keys:
                raise ck.fail(mnode, f"{fld}.{required}",
                              f"missing required key {required!r}; found keys: {keys_found(keys)}")
        cnodes = ck.sequence(keys["cycle"][1], f"{fld}.cycle")
        if not cnodes:
            raise ck.fail(keys["cycle"][1], f"{fld}.cycle", "found an empty list, expected at least one movement")
        cycle: list[str] = []
        for j, cnode in enumerate(cnodes):
            cname = ck.string(cnode, f"{fld}.cycle[{j}]")
            ck.one_of(cnode, f"{fld}.cycle[{j}]", cname, names)
            if cname in cycle:
                raise ck.fail(cnode, f"{fld}.cycle[{j}]",
                              f"found {cname!r} a second time; a cycle names each movement once")
            cycle.append(cname)
        threshold = ck.integer(keys["threshold"][1], f"{fld}.threshold")
        if ("judge" in keys) == ("next" in keys):
            raise ck.fail(mnode, f"{fld}.judge", "give exactly one of 'judge' and 'next'; found "
                          + ("both" if "judge" in keys else f"neither (keys: {keys_found(keys)})"))
        mname = "judge:" + "/".join(cycle)
        if "name" in keys:
            mname = ck.string(keys["name"][1], f"{fld}.name")
        name_node = keys["name"][1] if "name" in keys else mnode
        if mname in names or mname in SPECIAL_NEXT:
            raise ck.fail(name_node, f"{fld}.name", f"found {mname!r}, the name of a movement or a special next "
                          "step; a monitor's judge runs under the monitor's name, which must be its own")
        if mname in taken:
            raise ck.fail(name_node, f"{fld}.name", f"duplicate loop monitor name {mname!r} (first at line "
                          f"{taken[mname]}); give each monitor its own name:")
        taken[mname] = name_node.start_mark.line + 1
        judge: Movement | None = None
        nxt: str | None = None
        if "judge" in keys:
            judge = _judge(ck, keys["judge"][1], f"{fld}.judge", mname, targets)
        else:
            nxt = ck.string(keys["next"][1], f"{fld}.next")
            _loop_target(ck, keys["next"][1], f"{fld}.next", nxt, targets)
        monitors.append(LoopMonitor(name=mname, cycle=tuple(cycle), threshold=threshold, judge=judge, next=nxt))
    return tuple(monitors)


def _loop_target(ck: Checker, node: Node, fld: str, value: str, targets: tuple[str, ...]) -> None:
    """Where a monitor or its judge may send the job: a movement, COMPLETE or ABORT (see ``LOOP_NEXT``)."""
    if value in SPECIAL_NEXT and value not in LOOP_NEXT:
        raise ck.fail(node, fld, f"found {value!r}, which a loop monitor cannot go to (it has no question to ask "
                      f"and no subtasks to hand out); allowed: {', '.join(targets)}")
    ck.one_of(node, fld, value, targets)


def _judge(ck: Checker, node: Node, fld: str, name: str, targets: tuple[str, ...]) -> Movement:
    """A monitor's ``judge:`` as the movement its run is: tool-less, read-only, named after the monitor."""
    jkeys = ck.mapping(node, fld, _JUDGE_KEYS)
    if "rules" not in jkeys:
        raise ck.fail(node, f"{fld}.rules", f"missing required key 'rules'; found keys: {keys_found(jkeys)}")
    rules = _rules(ck, jkeys["rules"][1], f"{fld}.rules")
    if not rules:
        raise ck.fail(jkeys["rules"][1], f"{fld}.rules", "found an empty list, expected at least one rule")
    for j, rnode in enumerate(ck.sequence(jkeys["rules"][1], "")):
        nnode = next(v for k, v in rnode.value if k.value == "next")
        _loop_target(ck, nnode, f"{fld}.rules[{j}].next", rules[j].next, targets)
    return Movement(
        name=name,
        persona=ck.optional(jkeys, "persona", _JUDGE_PERSONA, lambda n, f: ck.string(n, f"{fld}.{f}")),
        instruction=ck.optional(jkeys, "instruction", _JUDGE_INSTRUCTION, lambda n, f: ck.string(n, f"{fld}.{f}")),
        rules=rules, max_iterations=JUDGE_MAX_ITERATIONS,
    )


def _compose(text: str, source: str) -> Node:
    """The YAML node tree of ``text``; a parse error or an empty file is a :class:`PieceError` with its line."""
    try:
        root = yaml.compose(text, Loader=FastLoader)
    except yaml.YAMLError:
        try:
            root = yaml.compose(text)  # the pure-Python parser words some errors better
        except yaml.YAMLError as exc:
            raise yaml_error(exc, text, source) from None
    if root is None:
        raise PieceError("found an empty file, expected a mapping with at least name and movements",
                         file=source, line=1, field=TOP)
    return root


def _context(ck: Checker, top: Keys) -> tuple[int | None, int | None, dict[str, float], dict[str, Any]]:
    """The piece's ``context:`` settings: window tokens, minimum tool tokens, the thresholds and the
    compaction settings (only those given)."""
    thresholds = dict(DEFAULT_THRESHOLDS)
    if "context" not in top or (isinstance(top["context"][1], ScalarNode) and top["context"][1].value == ""):
        return None, None, thresholds, {}
    ctx = ck.mapping(top["context"][1], "context", _CONTEXT_KEYS)
    window = ck.optional(ctx, "window_tokens", None, lambda n, f: ck.integer(n, f"context.{f}", minimum=256))
    min_tool = ck.optional(ctx, "min_tool_tokens", None, lambda n, f: ck.integer(n, f"context.{f}"))
    if "thresholds" in ctx:
        thresholds = _thresholds(ck, ctx["thresholds"][1])
    return window, min_tool, thresholds, _compaction(ck, ctx, "context")


def _compaction(ck: Checker, ctx: Keys, fld: str) -> dict[str, Any]:
    """``on_pressure``, ``compact_keep_last`` (≥ 0) and ``max_compactions`` (≥ 0) of a ``context:``, those given."""
    out: dict[str, Any] = {}
    if "on_pressure" in ctx:
        out["on_pressure"] = ck.string(ctx["on_pressure"][1], f"{fld}.on_pressure", choices=ON_PRESSURE)
    for key in ("compact_keep_last", "max_compactions"):
        if key in ctx:
            out[key] = ck.integer(ctx[key][1], f"{fld}.{key}", minimum=0)
    return out


def _thresholds(ck: Checker, node: Node) -> dict[str, float]:
    """``context.thresholds``: ratios over the defaults, which must rise from warn to exhausted."""
    th = ck.mapping(node, "context.thresholds", DEFAULT_THRESHOLDS)
    thresholds = dict(DEFAULT_THRESHOLDS)
    for key, (_, vnode) in th.items():
        thresholds[key] = ck.ratio(vnode, f"context.thresholds.{key}")
    for lower, upper in itertools.pairwise(DEFAULT_THRESHOLDS):
        if thresholds[lower] > thresholds[upper]:
            bad = th.get(lower, th.get(upper, (node, node)))[1]
            raise ck.fail(
                bad, f"context.thresholds.{lower}",
                f"found {lower}={thresholds[lower]} above {upper}={thresholds[upper]}; "
                "thresholds must rise: warn ≤ prompt ≤ force_transition ≤ exhausted",
            )
    return thresholds


def _movement(
    ck: Checker, i: int, mnode: Node, known: tuple[str, ...], seen: dict[str, int], servers: dict[str, McpServer]
) -> tuple[Movement, Keys, str]:
    """Movement ``i``, with its keys and its field name for later errors; ``seen`` collects the names."""
    fld = f"movements[{i}]"
    keys = ck.mapping(mnode, fld, _MOVEMENT_KEYS)
    if "name" not in keys:
        raise ck.fail(mnode, f"{fld}.name", f"missing required key 'name'; found keys: {keys_found(keys)}")
    name_node = keys["name"][1]
    mname = ck.string(name_node, f"{fld}.name")
    if mname in SPECIAL_NEXT:
        raise ck.fail(name_node, f"{fld}.name", f"found {mname!r}, which is reserved for a special next step")
    if mname in seen:
        raise ck.fail(name_node, f"{fld}.name",
                      f"duplicate movement name {mname!r} (first defined at line {seen[mname]})")
    seen[mname] = name_node.start_mark.line + 1
    fld = f"movements[{i}] ({mname})"
    persona = ck.text_or_file(keys, fld, "persona", required=False, owner=mnode)
    instruction = ck.text_or_file(keys, fld, "instruction", required=True, owner=mnode)
    permission = ck.optional(keys, "permission", "readonly",
                             lambda n, f: ck.string(n, f"{fld}.{f}", choices=PERMISSIONS))
    tools = _tools(ck, keys["tools"][1], f"{fld}.tools", known, servers, permission) if "tools" in keys else ()
    movement = Movement(
        name=mname, persona=persona, instruction=instruction, tools=tools, permission=permission,
        max_iterations=ck.optional(keys, "max_iterations", 20, lambda n, f: ck.integer(n, f"{fld}.{f}")),
        rules=_rules(ck, keys["rules"][1], f"{fld}.rules") if "rules" in keys else (),
        default_next=ck.optional(keys, "default_next", None, lambda n, f: ck.string(n, f"{fld}.{f}")),
        verify=ck.optional(keys, "verify", None, lambda n, f: ck.string(n, f"{fld}.{f}")),
        description=ck.optional(keys, "description", "", lambda n, f: ck.string(n, f"{fld}.{f}", nonempty=False)),
        **_movement_context(ck, keys, fld),
    )
    return movement, keys, fld


def _movement_context(ck: Checker, keys: Keys, fld: str) -> dict[str, Any]:
    """A movement's own ``context:`` — only the compaction settings; the window and thresholds are the piece's."""
    if "context" not in keys or (isinstance(keys["context"][1], ScalarNode) and keys["context"][1].value == ""):
        return {}
    ctx = ck.mapping(keys["context"][1], f"{fld}.context", _MOVEMENT_CONTEXT_KEYS)
    return _compaction(ck, ctx, f"{fld}.context")


def _tools(ck: Checker, node: Node, fld: str, known: tuple[str, ...], servers: dict[str, McpServer],
           permission: str) -> tuple[str, ...]:
    """A movement's ``tools:``: known names or ``server.tool`` of a declared MCP server, each once;
    ``transition`` is always allowed and not listed."""
    tools: list[str] = []
    tool_lines: dict[str, int] = {}
    for j, tnode in enumerate(ck.sequence(node, fld)):
        tname = ck.string(tnode, f"{fld}[{j}]")
        if tname == "transition":
            continue  # always allowed
        if "." in tname:  # no registered tool has a dot in its name
            check_mcp_tool(ck, tnode, f"{fld}[{j}]", tname, servers, permission)
        elif tname not in known:
            raise ck.fail(tnode, f"{fld}[{j}]", f"unknown tool {tname!r}; allowed: {', '.join(known)}")
        if tname in tool_lines:
            # the model would be sent two functions of one name, which endpoints refuse
            raise ck.fail(tnode, f"{fld}[{j}]",
                          f"found {tname!r} a second time (first listed at line {tool_lines[tname]}); "
                          "list each tool once")
        tool_lines[tname] = tnode.start_mark.line + 1
        tools.append(tname)
    return tuple(tools)


def _rules(ck: Checker, node: Node, fld: str) -> tuple[Rule, ...]:
    """A movement's ``rules:``, each a ``next`` with an optional ``condition`` (targets are checked later)."""
    rules: list[Rule] = []
    for j, rnode in enumerate(ck.sequence(node, fld)):
        rkeys = ck.mapping(rnode, f"{fld}[{j}]", _RULE_KEYS)
        if "next" not in rkeys:
            raise ck.fail(rnode, f"{fld}[{j}].next", f"missing required key 'next'; found keys: {keys_found(rkeys)}")
        cond = ck.string(rkeys["condition"][1], f"{fld}[{j}].condition") if "condition" in rkeys else ""
        rules.append(Rule(condition=cond, next=ck.string(rkeys["next"][1], f"{fld}[{j}].next")))
    return tuple(rules)


def _check_next_steps(ck: Checker, movement: Movement, keys: Keys, fld: str, names: tuple[str, ...]) -> None:
    """The movements a movement's rules, ``default_next`` and ``verify`` name exist (verify: another one)."""
    targets = names + SPECIAL_NEXT
    rule_nodes = ck.sequence(keys["rules"][1], "") if "rules" in keys else []
    for j, (rule, rnode) in enumerate(zip(movement.rules, rule_nodes, strict=True)):
        nnode = next(v for k, v in rnode.value if k.value == "next")
        ck.one_of(nnode, f"{fld}.rules[{j}].next", rule.next, targets)
    if movement.default_next is not None:
        ck.one_of(keys["default_next"][1], f"{fld}.default_next", movement.default_next, targets)
    if movement.verify is not None:
        others = tuple(n for n in names if n != movement.name)
        if movement.verify == movement.name:
            raise ck.fail(keys["verify"][1], f"{fld}.verify",
                          f"found {movement.verify!r}, the movement itself; allowed: {', '.join(others) or 'none'} "
                          "(verify names the movement whose work this one checks)")
        ck.one_of(keys["verify"][1], f"{fld}.verify", movement.verify, others)


def piece_search_path() -> list[Path]:
    """Where piece names are looked up, in order: ``./pieces``, then the package's pieces."""
    return [Path.cwd() / "pieces", PACKAGE_PIECES]


def available_pieces() -> dict[str, Path]:
    """Piece name → file, the first found along :func:`piece_search_path` winning."""
    found: dict[str, Path] = {}
    for folder in piece_search_path():
        if folder.is_dir():
            for path in sorted(folder.glob("*.y*ml")):
                if path.suffix in (".yaml", ".yml"):
                    found.setdefault(path.stem, path)
    return found


def load_piece(ref: str | os.PathLike[str] | Piece, *, known_tools: Iterable[str] | None = None) -> Piece:
    """Load a piece from a file path, by name (``./pieces/<name>.yaml``, then the package) or from YAML text
    (a string with a line break)."""
    if isinstance(ref, Piece):
        return ref
    if isinstance(ref, str) and "\n" in ref:
        return parse_piece(ref, source="<piece text>", known_tools=known_tools)
    if not isinstance(ref, (str, os.PathLike)):
        raise PieceError(f"piece must be a name, a YAML path or a Piece, not {type(ref).__name__} {ref!r}",
                         field="piece")
    text_ref = os.fspath(ref)
    path = Path(text_ref)
    looks_like_path = path.suffix in (".yaml", ".yml") or os.sep in text_ref or "/" in text_ref
    if not looks_like_path:
        candidates = available_pieces()
        if text_ref not in candidates:
            names = ", ".join(sorted(candidates)) or "none"
            raise PieceError(
                f"unknown piece {text_ref!r}; available: {names} (searched ./pieces and the package)",
                file=text_ref,
            )
        path = candidates[text_ref]
    if not path.is_file():
        raise PieceError("no such piece file", file=str(path))
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        head = raw[: exc.start].decode("utf-8", errors="replace")
        raise PieceError(
            f"found byte 0x{raw[exc.start]:02x}, which is not UTF-8; allowed: UTF-8 text (save the file as UTF-8)",
            file=str(path), line=line, field=yaml_field(head + "\n", line) if line > 1 or head.strip() else TOP,
        ) from None
    return parse_piece(text, source=str(path), base_dir=path.parent, known_tools=known_tools)

