"""Span records as OTLP messages, built directly (docs/otel.md): no SDK spans in between.

:mod:`agentnb.views._otel_spans` maps a job to plain :class:`SpanRecord`s; this module turns them into the
messages of the OTLP trace protocol with the OpenTelemetry packages' own message classes, in one of two
families that share OTLP's field names:

- ``opentelemetry-proto``'s protobuf messages (:data:`PROTO`): serialised to bytes for OTLP/HTTP, or to JSON by
  protobuf's ``json_format`` (tests read files back that way);
- ``opentelemetry-proto-json``'s generated classes (:data:`JSON`), whose ``to_dict`` is OTLP's JSON encoding
  itself (hex ids, enums as integers, 64-bit integers as strings): the file export's lines.

Both are filled exactly as the exporter package's ``encode_spans`` fills them from the SDK's spans (the same
flags, statuses and attribute values), so a file, a ``send`` and a live export carry the same spans; building
them directly skips two conversions per span (record → ``ReadableSpan`` → message), which were most of an
export's time (benchmarks/README.md).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._otel_spans import AttrValue, SpanRecord, TraceRecord

__all__ = ["Family", "json_family", "post", "proto_family", "resource_spans"]

SCOPE = "agentnb"
# SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK: the parent is known not to be remote (the exporter's encoder sets the
# same for an SDK span)
_FLAGS = 0x100
_INTERNAL, _CLIENT = 1, 3  # Span.SpanKind
_ERROR = 2  # Status.StatusCode


@dataclass(frozen=True, slots=True)
class Family:
    """The message classes of one family (protobuf or proto-json): same names, same fields."""

    AnyValue: Any
    ArrayValue: Any
    KeyValue: Any
    Resource: Any
    InstrumentationScope: Any
    ResourceSpans: Any
    ScopeSpans: Any
    Span: Any
    Status: Any


@functools.cache
def proto_family() -> Family:
    from opentelemetry.proto.common.v1 import common_pb2 as c
    from opentelemetry.proto.resource.v1 import resource_pb2 as r
    from opentelemetry.proto.trace.v1 import trace_pb2 as t

    return Family(c.AnyValue, c.ArrayValue, c.KeyValue, r.Resource, c.InstrumentationScope, t.ResourceSpans,
                  t.ScopeSpans, t.Span, t.Status)


@functools.cache
def json_family() -> Family:
    from opentelemetry.proto_json.common.v1 import common as c
    from opentelemetry.proto_json.resource.v1 import resource as r
    from opentelemetry.proto_json.trace.v1 import trace as t

    return Family(c.AnyValue, c.ArrayValue, c.KeyValue, r.Resource, c.InstrumentationScope, t.ResourceSpans,
                  t.ScopeSpans, t.Span, t.Status)


class _Builder:
    def __init__(self, f: Family) -> None:
        self.f = f
        # the (key, value) pairs that recur on every span of a kind (operation, model, job, tool names) are built
        # once per export; a message shared between spans is only read, never changed
        self.pairs: dict[tuple[str, type, Any], Any] = {}
        self.unset = f.Status()

    def value(self, v: AttrValue) -> Any:
        f = self.f
        # the order of the exporter's _encode_value: bool is an int, a str is a sequence
        if isinstance(v, bool):
            return f.AnyValue(bool_value=v)
        if isinstance(v, str):
            return f.AnyValue(string_value=v)
        if isinstance(v, int):
            return f.AnyValue(int_value=v)
        if isinstance(v, float):
            return f.AnyValue(double_value=v)
        return f.AnyValue(array_value=f.ArrayValue(values=[self.value(x) for x in v]))

    def attributes(self, attributes: Mapping[str, AttrValue]) -> list[Any]:
        out = []
        pairs = self.pairs
        for k, v in attributes.items():
            key = (k, type(v), v if isinstance(v, (str, int, float)) else tuple(v))
            kv = pairs.get(key)
            if kv is None:
                kv = pairs[key] = self.f.KeyValue(key=k, value=self.value(v))
            out.append(kv)
        return out

    def span(self, trace_id: bytes, s: SpanRecord) -> Any:
        f = self.f
        attributes = s.attributes
        status = self.unset
        if s.error is not None:
            attributes = {**attributes, "error.type": s.error}
            status = f.Status(code=_ERROR, message=s.error_message or s.error)
        return f.Span(
            trace_id=trace_id, span_id=s.span_id.to_bytes(8, "big"),
            parent_span_id=s.parent_id.to_bytes(8, "big") if s.parent_id is not None else None,
            flags=_FLAGS, name=s.name, kind=_CLIENT if s.kind == "client" else _INTERNAL,
            start_time_unix_nano=_ns(s.start), end_time_unix_nano=_ns(s.end),
            attributes=self.attributes(attributes),
            events=[f.Span.Event(name=e.name, time_unix_nano=_ns(e.ts), attributes=self.attributes(e.attributes))
                    for e in s.events] or None,
            status=status)


def _ns(seconds: float) -> int:
    return round(seconds * 1_000_000_000)


def resource_spans(family: Family, traces: Iterable[TraceRecord]) -> list[Any]:
    """One ``ResourceSpans`` per trace (its resource, the ``agentnb`` scope, its spans), in ``family``'s classes."""
    b = _Builder(family)
    f = family
    out = []
    for trace in traces:
        trace_id = trace.trace_id.to_bytes(16, "big")
        out.append(f.ResourceSpans(
            resource=f.Resource(attributes=b.attributes(trace.resource)),
            scope_spans=[f.ScopeSpans(scope=f.InstrumentationScope(name=SCOPE),
                                      spans=[b.span(trace_id, s) for s in trace.spans])]))
    return out


def post(exporter: Any, traces: Sequence[TraceRecord]) -> bool:
    """Post the spans of ``traces`` as one OTLP/HTTP request with ``exporter`` (an ``OTLPSpanExporter``); True when
    the collector took them.

    The exporter's ``export`` takes only SDK spans, which it encodes again; its HTTP client (the endpoint, the
    ``OTEL_EXPORTER_OTLP_*`` headers, compression and TLS it was configured with, its retries) posts the
    ``ExportTraceServiceRequest`` built here.  That client is the exporter's ``_client`` attribute
    (opentelemetry-exporter-otlp-proto-http 1.45, the version the extra asks for)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    data = ExportTraceServiceRequest(resource_spans=resource_spans(proto_family(), traces)).SerializeToString()
    return bool(exporter._client.export(data).success)
