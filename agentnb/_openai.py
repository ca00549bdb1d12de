"""The ``openai:<model>`` adapter: Chat Completions with tools, on any OpenAI-compatible endpoint."""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

from .models import ModelError, ModelRequest, ModelResponse, ToolCall

__all__ = ["OpenAIModel"]


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class OpenAIModel:
    """Calls ``client.chat.completions.create`` with retries and backoff on 429, 5xx and timeouts.

    The key comes from ``OPENAI_API_KEY`` and the endpoint from ``OPENAI_BASE_URL``;
    neither is ever recorded.
    """

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        max_retries: int | None = None,
        backoff: float | None = None,
        timeout: float | None = None,
    ) -> None:
        self.model = model
        self.spec = f"openai:{model}"
        self.base_url = base_url or os.environ.get("OPENAI_BASE_URL") or None
        self._api_key = api_key or os.environ.get("OPENAI_API_KEY")
        self.max_retries = int(max_retries if max_retries is not None else _env_float("AGENTNB_OPENAI_RETRIES", 4))
        self.backoff = backoff if backoff is not None else _env_float("AGENTNB_OPENAI_BACKOFF", 1.0)
        self.timeout = timeout if timeout is not None else _env_float("AGENTNB_OPENAI_TIMEOUT", 120.0)
        self._client: Any = None

    def __repr__(self) -> str:  # never show the key
        return f"OpenAIModel({self.model!r}, base_url={self.base_url!r})"

    def _get_client(self) -> Any:
        if self._client is None:
            import openai

            if not self._api_key:
                if self.base_url is None:
                    raise ModelError(
                        "openai model needs OPENAI_API_KEY (and OPENAI_BASE_URL for a non-OpenAI endpoint)"
                    )
            self._client = openai.OpenAI(
                api_key=self._api_key or "not-needed", base_url=self.base_url, max_retries=0, timeout=self.timeout
            )
        return self._client

    def complete(self, request: ModelRequest) -> ModelResponse:
        import openai

        client = self._get_client()
        kwargs: dict[str, Any] = {"model": self.model, "messages": request.messages}
        if request.tools:
            kwargs["tools"] = request.tools
            kwargs["tool_choice"] = "auto"
        attempts = self.max_retries + 1
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                resp = client.chat.completions.create(**kwargs)
                return self._convert(resp)
            except (openai.RateLimitError, openai.InternalServerError, openai.APITimeoutError,
                    openai.APIConnectionError) as exc:
                last = exc
                if attempt + 1 < attempts:
                    delay = self._retry_after(exc) or self.backoff * (2 ** attempt) * (0.5 + random.random() / 2)
                    time.sleep(min(delay, 60.0))
            except openai.APIStatusError as exc:
                raise ModelError(f"{self.spec}: HTTP {exc.status_code}: {_message(exc)}") from None
            except openai.OpenAIError as exc:
                raise ModelError(f"{self.spec}: {type(exc).__name__}: {exc}") from None
        status = getattr(last, "status_code", None)
        what = f"HTTP {status}: {_message(last)}" if status else f"{type(last).__name__}: {last}"
        raise ModelError(f"{self.spec}: gave up after {attempts} tries; last error {what}")

    @staticmethod
    def _retry_after(exc: Exception) -> float | None:
        """The wait the server asked for: ``retry-after-ms``, ``retry-after`` in seconds or as an HTTP date."""
        response = getattr(exc, "response", None)
        if response is None:
            return None
        try:
            ms = response.headers.get("retry-after-ms")
            if ms:
                return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
        header = response.headers.get("retry-after")
        if not header:
            return None
        try:
            return max(0.0, float(header))
        except ValueError:
            pass
        try:
            from email.utils import parsedate_to_datetime

            return max(0.0, parsedate_to_datetime(header).timestamp() - time.time())
        except (TypeError, ValueError, IndexError):
            return None

    @staticmethod
    def _convert(resp: Any) -> ModelResponse:
        if not getattr(resp, "choices", None):
            raise ModelError("the endpoint returned no choices")
        msg = resp.choices[0].message
        calls = []
        for tc in msg.tool_calls or []:
            raw = tc.function.arguments
            if isinstance(raw, (dict, list)):  # some compatible servers send an object, not JSON text
                args: Any = raw
                raw = json.dumps(raw, ensure_ascii=False)
            else:
                raw = raw if isinstance(raw, str) and raw.strip() else "{}"
                try:
                    args = json.loads(raw)
                except json.JSONDecodeError:
                    args = raw  # the tool reports it; the model's text is kept verbatim
                if isinstance(args, str):  # JSON text encoded twice: the object is one decode further
                    try:
                        inner = json.loads(args)
                    except json.JSONDecodeError:
                        inner = None
                    if isinstance(inner, dict):
                        args = inner
            calls.append(ToolCall(id=tc.id, name=tc.function.name, arguments=args, raw_arguments=raw))
        usage = None
        if resp.usage is not None and resp.usage.prompt_tokens is not None:
            usage = {
                "prompt_tokens": int(resp.usage.prompt_tokens),
                "completion_tokens": int(resp.usage.completion_tokens or 0),
            }
        return ModelResponse(content=msg.content, tool_calls=tuple(calls), usage=usage)


def _message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    return str(getattr(exc, "message", exc))
