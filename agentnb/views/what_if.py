"""What-if for the ContextManager (docs/fork-compare.md#what-if): a job's recorded calls under another window or thresholds.

``ws.frames.what_if(job, window=8000, thresholds={"prompt": 0.8})`` is the job's usage frame
(``ws.frames.usage(job)``, every column) with the ContextManager's actions recomputed from the recorded
prompt token counts, each new column right after its recorded twin (``ratio``, ``ratio_what_if``;
``action``, ``action_recorded``, ``action_what_if``; ``actions``, ``actions_what_if``; ``forced``,
``forced_what_if``, ``first_forced``), so the two sit side by side when the frame is displayed:

==================== ===========================================================================
column               meaning
==================== ===========================================================================
``action_recorded``  the highest action the record fired at that call (a copy of ``action``)
``action_what_if``   the highest action that would fire at that call under the new settings
``actions_what_if``  all of them, comma-separated in firing order (like ``actions``)
``ratio_what_if``    prompt tokens / the new window, rounded to 6 decimals as the record's ``ratio`` is
``forced_what_if``   True at the call where ``force_transition`` would fire: that movement run would have
                     been forced to transition there (at most one call per run)
``first_forced``     True only at the first such call of the job: from there on the simulation no longer
                     describes what would have happened
==================== ===========================================================================

The rule is the seed's (``engine/context.py``, ``ContextManager.after_response``): each movement run starts
with nothing fired; at each call, in the order warn, prompt, force_transition, exhausted, an action fires
when the call's ratio is at or above its threshold and it has not fired yet in that run.  So each action
fires at most once per run, at the first call whose ratio reaches its threshold.

This is a simulation of the ContextManager **alone**: the recorded conversation is taken as it was.  Had a
movement been prompted to wrap up or forced to transition earlier, everything after that point (the
model's answers, the tokens, the next movements) would have been different; and calls the job never made
(because the recorded run ended earlier) cannot be simulated.  ``first_forced`` marks where the first of
those departures would have happened.

A job that compacted (docs/context.md#compaction, ``context.on_pressure: compact``): a compaction's summarisation call is
no turn of the conversation, and the ContextManager fires nothing on it, so nothing is simulated on it
either: its row is passed through with ``action_recorded`` ``compaction``, no ``action_what_if`` (NA), its
``ratio_what_if`` (the summarisation request's size over the window) and ``forced_what_if`` False.  After it
the record's ContextManager re-armed (each action may fire again in the rest of the run), and so does the
simulation: a run is simulated in parts, each compaction starting a new one.  Under other settings the
compaction itself would have come at another call (when ``prompt`` fired) or not at all; the conversation
after it is the compacted one as recorded, like any call after a departure.

``window=None`` keeps each call's recorded window; ``thresholds`` may name only some actions: they are
merged over the thresholds the job ran with and checked by the rules of ``context=``
(``engine.context.check_thresholds``).  A call a fork re-served (``replayed_from`` set on its
``llm_response``) records 0 tokens, since nothing was spent: its prompt is taken as
``round(ratio × recorded window)``, the context as it was.  The frame's ``attrs["what_if"]`` holds the
settings used (``{"window": …, "thresholds": {…}}``; ``window`` is None when the calls' recorded windows
differ and none was given).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import Any

import numpy as np
import pandas as pd

from ..engine.context import check_thresholds
from ..engine.pieces import DEFAULT_THRESHOLDS
from ..errors import UsageError
from ..events import ACTIONS
from .style import COMPACTION, USAGE_ACTIONS

__all__ = ["MIN_WINDOW", "WHAT_IF_COLUMNS", "check_window", "simulate", "what_if_thresholds"]

WHAT_IF_COLUMNS = ("action_recorded", "action_what_if", "actions_what_if", "ratio_what_if", "forced_what_if",
                   "first_forced")
# where each what-if column goes: right after its recorded twin, so a displayed frame shows the pair together
_AFTER_TWIN = {"ratio": ("ratio_what_if",), "action": ("action_recorded", "action_what_if"),
               "actions": ("actions_what_if",), "forced": ("forced_what_if", "first_forced")}
# the smallest window context.window_tokens (a piece's or a job's) accepts
MIN_WINDOW = 256

# as usage's ``action`` (frames.ACTION_DTYPE): the four actions, then a compaction's summarisation call
_ACTION_DTYPE = pd.CategoricalDtype(list(USAGE_ACTIONS), ordered=True)
_NEEDED = ("job", "seq", "prompt_tokens", "window", "ratio", "action")


def check_window(window: Any) -> int | None:
    """``window`` as a whole number of tokens (None: each call's recorded window), or one UsageError line."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, Integral) or int(window) < MIN_WINDOW:
        raise UsageError(f"what_if: window={window!r}; allowed: a whole number of tokens ≥ {MIN_WINDOW} "
                         "(as context.window_tokens), or None for the job's recorded window")
    return int(window)


def what_if_thresholds(recorded: Mapping[str, float], thresholds: Mapping[str, Any] | None) -> dict[str, float]:
    """``thresholds`` (some or all actions) over the ones the job ran with, checked as ``context=`` is."""
    try:
        partial = check_thresholds(thresholds) if thresholds is not None else {}
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    base = {**DEFAULT_THRESHOLDS, **recorded}
    try:
        return check_thresholds({**base, **partial}, complete=True)
    except ValueError as exc:
        raise UsageError(f"{exc} (the what-if thresholds over the job's "
                         f"{', '.join(f'{k}={v}' for k, v in base.items())})") from None


def simulate(usage: pd.DataFrame, *, window: int | None = None, thresholds: Mapping[str, Any] | None = None,
             replayed: Sequence[bool] | np.ndarray | pd.Series | None = None) -> pd.DataFrame:
    """The what-if frame of a usage frame (``ws.frames.usage(job)``); see the module docstring.

    ``thresholds`` are merged over ``usage.attrs["thresholds"]`` (the job's; the defaults without it).
    ``replayed`` marks the re-served calls; without it a ``replayed`` column is used when the frame has one,
    else a call recording 0 prompt tokens at a ratio above 0 (only a re-served call can: a spent call's
    ratio is its prompt tokens over the window).
    """
    missing = [c for c in _NEEDED if c not in usage.columns]
    if missing:
        raise UsageError(f"what_if needs a ws.frames.usage() DataFrame; this one lacks {missing}")
    new_window = check_window(window)
    th = what_if_thresholds(usage.attrs.get("thresholds") or {}, thresholds)
    df = usage.copy()

    recorded_window = pd.to_numeric(df["window"]).astype("float64").to_numpy()
    ratio = pd.to_numeric(df["ratio"]).astype("float64").to_numpy()
    prompt = pd.to_numeric(df["prompt_tokens"]).astype("float64").to_numpy()
    if replayed is not None:
        served = np.asarray(replayed, dtype=bool)
        if served.shape != (len(df),):
            raise UsageError(f"what_if: replayed has {served.size} values for {len(df)} calls")
    elif "replayed" in df.columns:
        served = df["replayed"].fillna(False).to_numpy(dtype=bool)
    else:
        served = (prompt == 0) & (ratio > 0)
    # a re-served call spent nothing; its ratio and window keep the context it had
    prompt = np.where(served, np.round(ratio * recorded_window), prompt)
    windows = recorded_window if new_window is None else np.full(len(df), float(new_window))
    with np.errstate(divide="ignore", invalid="ignore"):
        # the same float as the ContextManager's prompt / window (both whole numbers below 2**53)
        ratio_wi = prompt / windows

    # a compaction's summarisation call fires nothing, and the ContextManager re-arms after it: each part of a
    # run between compactions is simulated on its own
    compacting = (df["action"].astype(object) == COMPACTION).fillna(False).to_numpy(dtype=bool)
    part = pd.Series(compacting.astype("int64"), index=df.index).groupby([df["job"], df["seq"]]).cumsum()
    # per movement run (part), each action fires once: at the first call at or above its threshold
    runs = [df["job"], df["seq"], part]
    fired: dict[str, np.ndarray] = {}
    for action in ACTIONS:
        # NaN compares False: no count, no action
        hit = pd.Series((ratio_wi >= th[action]) & ~compacting, index=df.index)
        fired[action] = (hit & (hit.astype("int64").groupby(runs).cumsum() == 1)).to_numpy()

    listed = np.full(len(df), "", dtype=object)
    for action in ACTIONS:  # in firing order, as the record's ``actions``
        at = fired[action]
        listed[at] = np.where(listed[at] == "", action, listed[at] + "," + action)
    codes = np.full(len(df), -1, dtype="int64")
    for code, action in enumerate(ACTIONS):
        codes[fired[action]] = code  # ACTIONS rise, so the last one set is the highest
    forced = fired["force_transition"]
    forced_s = pd.Series(forced, index=df.index)
    first = forced_s & (forced_s.astype("int64").groupby(df["job"]).cumsum() == 1)

    df["action_recorded"] = df["action"].astype(_ACTION_DTYPE)
    df["action_what_if"] = pd.Categorical.from_codes(codes, dtype=_ACTION_DTYPE)
    text = pd.Series(listed, index=df.index, dtype="string")
    df["actions_what_if"] = text.mask(text == "")  # NA where nothing fires, as the record's ``actions``
    # the actions above compare the exact quotient, as the ContextManager does; the column is rounded as the
    # record's ratio is (engine/loop.py; Python's round: np.round differs in the last place for some
    # quotients), so unchanged settings give back ``ratio`` exactly
    df["ratio_what_if"] = np.array([round(r, 6) for r in ratio_wi.tolist()], dtype="float64")
    df["forced_what_if"] = forced.astype(bool)
    df["first_forced"] = first.to_numpy(dtype=bool)
    df = df[_twinned([c for c in df.columns if c not in WHAT_IF_COLUMNS])]

    if new_window is None:
        known = pd.unique(recorded_window[~np.isnan(recorded_window)])
        shown = int(known[0]) if len(known) == 1 else None
    else:
        shown = new_window
    df.attrs = {**usage.attrs, "what_if": {"window": shown, "thresholds": th}}
    return df


def _twinned(columns: list[str]) -> list[str]:
    """``columns`` with each what-if column inserted after its twin; one whose twin is missing goes last."""
    order: list[str] = []
    for column in columns:
        order += [column, *_AFTER_TWIN.get(column, ())]
    return order + [c for c in WHAT_IF_COLUMNS if c not in order]
