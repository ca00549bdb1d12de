"""A batch's results as DataFrames and HTML (DESIGN §10): ``batch.frame``, ``batch.summary()``, its view.

First version: the jobs and their status only; the totals, cost, seconds and scores come next.
"""

from __future__ import annotations

import html
import json
from typing import Any

import pandas as pd

__all__ = ["batch_frame", "batch_html", "batch_summary"]


def batch_frame(batch: Any) -> pd.DataFrame:
    """One row per case × variant."""
    row = batch.ws.store.batch(batch.name)
    cases = json.loads(row["cases"]) if row else []
    variants = json.loads(row["variants"]) if row else []
    rows = []
    for job in batch.ws.store.jobs(batch=batch.name):
        case, variant = job["batch_case"], job["batch_variant"]
        rows.append({"case": case, **cases[case].get("extra", {}), "piece": variants[variant]["piece"],
                     "model": variants[variant]["model"], "job": job["id"], "status": job["status"]})
    return pd.DataFrame(rows)


def batch_summary(batch: Any) -> pd.DataFrame:
    """One row per variant."""
    df = batch_frame(batch)
    if df.empty:
        return pd.DataFrame(columns=["piece", "model", "n"])
    return df.groupby(["piece", "model"], sort=False).size().rename("n").reset_index()


def batch_html(batch: Any) -> str:
    return f"<div><b>{html.escape(repr(batch))}</b>{batch_summary(batch).to_html(index=False)}</div>"
