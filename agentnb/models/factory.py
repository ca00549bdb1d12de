"""The model for a spec: ``demo``, ``scripted:PATH``, ``openai:NAME`` or ``replay:JOB``.

Apart from :mod:`.base` so that the base (the request, the response, the scripted and replayed
models every adapter shares) imports no adapter: the adapters import the base, and this module
imports them all (the ``openai`` one when such a model is first made).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ModelSpecError
from .base import MODEL_SPECS, Model, ScriptedModel, demo_pace
from .demo import DemoModel
from .replay import ReplayModel

if TYPE_CHECKING:
    from ..store.base import Store

__all__ = ["resolve_model"]


def resolve_model(spec: str, *, store: Store | None = None, retries: int | None = None,
                  max_backoff: float | None = None, stream: bool | None = None, epoch: int | None = None) -> Model:
    """Build the model for a spec; :class:`ModelSpecError` names what is allowed.

    ``retries`` and ``max_backoff`` configure an ``openai:`` model (``None``: its environment
    variables, then its defaults); other models have nothing to retry and ignore them.  ``stream`` (a workspace's
    setting; None: ``AGENTNB_STREAM``, else on) is whether an ``openai:`` model streams (docs/models.md#streaming).
    ``epoch``: the batch epoch of the job the model answers (docs/models.md#epochs), which a ``scripted:`` model's
    ``by_epoch`` responses choose by; the other models answer every epoch alike.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(f"empty model spec; allowed: {', '.join(MODEL_SPECS)}")
    kind, _, rest = spec.partition(":")
    if spec == "demo" or spec.startswith("demo?"):
        return DemoModel(pace=demo_pace(spec), spec=spec)
    if kind == "scripted" and rest:
        return ScriptedModel(rest, spec=spec, epoch=epoch)
    if kind == "openai" and rest:
        from .openai import OpenAIModel  # the openai SDK, ssl: only a process that calls an endpoint pays them

        return OpenAIModel(rest, max_retries=retries, max_backoff=max_backoff, stream=stream)
    if kind == "replay" and rest:
        if store is None:
            raise ModelSpecError("replay:<job_id> needs a workspace")
        try:
            job_id = int(rest)
        except ValueError:
            raise ModelSpecError(f"replay:{rest}: the job id must be a number") from None
        try:
            return ReplayModel(store, job_id)
        except Exception as exc:
            raise ModelSpecError(f"replay:{rest}: {exc}") from None
    raise ModelSpecError(f"unknown model spec {spec!r}; allowed: {', '.join(MODEL_SPECS)}")
