"""``agentnb cache stats`` / ``agentnb cache clear [--older-than 7d]`` and the ``--cache [MODE]`` option of ``run`` and
``batch`` (docs/cli.md#agentnb-cache-stats, docs/design-lab.md#call-cache); apart from ``cli.py``, which only wires them in."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .engine.callcache import cache_stats, clear_cache, parse_age

if TYPE_CHECKING:
    from .workspace import Workspace

__all__ = ["add_cache_commands", "add_cache_option"]

OpenWorkspace = Callable[..., "Workspace"]  # cli's: the command's workspace from its --workspace/--store


def add_cache_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", nargs="?", const="on", default=None, metavar="MODE",
                   help="answer LLM calls from the call cache when an identical request was made before "
                        "(MODE: on, the default, or across-epochs)")


def add_cache_commands(sub: Any, workspace: OpenWorkspace, parser_class: type[argparse.ArgumentParser]) -> None:
    """The ``cache`` command and its two sub-commands, on ``sub`` (the top-level sub-parsers)."""
    p = sub.add_parser("cache", help="the call cache: cache stats, cache clear [--older-than 7d]")
    cache_sub = p.add_subparsers(dest="cache_command", parser_class=parser_class, required=True)
    stats = cache_sub.add_parser("stats", help="recorded responses, hits and the tokens they saved")
    clear = cache_sub.add_parser("clear", help="delete recorded responses (all, or those older than --older-than)")
    clear.add_argument("--older-than", metavar="AGE", help="only what was recorded longer ago: 30m, 12h, 7d, 2w")
    for q in (stats, clear):
        q.add_argument("--workspace", default=argparse.SUPPRESS, help="workspace folder")
        q.add_argument("--store", default=argparse.SUPPRESS, help="store URL (postgresql://… or sqlite:///…)")

    def run_stats(args: argparse.Namespace) -> int:
        ws = workspace(args, readonly=True)
        for line in cache_stats(ws.store).lines(str(ws.store.path)):
            print(line)
        return 0

    def run_clear(args: argparse.Namespace) -> int:
        if args.older_than is not None:
            parse_age(args.older_than)  # a bad age: one line, before the store is opened
        ws = workspace(args)
        n = clear_cache(ws.store, args.older_than)
        print(f"cleared {n:,} cache entr{'y' if n == 1 else 'ies'}"
              + (f" older than {args.older_than}" if args.older_than else "") + f" from {ws.store.path}")
        return 0

    stats.set_defaults(fn=run_stats)
    clear.set_defaults(fn=run_clear)
