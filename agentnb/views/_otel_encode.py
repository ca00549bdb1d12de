"""Span records as OTLP messages, built directly (docs/otel.md): no SDK spans in between.

:mod:`agentnb.views._otel_spans` maps a job to plain :class:`SpanRecord`s; this module turns them into the
messages of the OTLP trace protocol with the OpenTelemetry packages' own message classes:

- :func:`request`: ``opentelemetry-proto``'s protobuf ``ExportTraceServiceRequest``, serialised for OTLP/HTTP
  (:func:`post`, with the OTLP exporter's HTTP client) or read as a ``TracesData``;
- :func:`traces_data_json`: ``opentelemetry-proto-json``'s ``TracesData``, whose ``to_dict`` is OTLP's JSON
  encoding itself (hex ids, enums as integers, 64-bit integers as strings): the file export's lines.

Both are filled as the exporter package's ``encode_spans`` fills them from the SDK's ``ReadableSpan``s (the same
flags, statuses and attribute values; tests/test_otel.py compares them), so a file, a ``send`` and a live export
carry the same spans.  Building them directly skips two conversions per span (record → ``ReadableSpan`` →
message) and protobuf's pure-Python JSON printer, which were most of an export's time (benchmarks/README.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._otel_spans import AttrValue, SpanRecord, TraceRecord

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

__all__ = ["post", "request", "sdk_spans", "traces_data_json"]

SCOPE = "agentnb"
# SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK: the parent is known not to be remote (the exporter's encoder sets the
# same for an SDK span)
_FLAGS = 0x100
_INTERNAL, _CLIENT = 1, 3  # Span.SpanKind
_ERROR = 2  # Status.StatusCode


def _kind(s: SpanRecord) -> int:
    return _CLIENT if s.kind == "client" else _INTERNAL


def _ns(seconds: float) -> int:
    return round(seconds * 1_000_000_000)


def _with_error(s: SpanRecord) -> Mapping[str, AttrValue]:
    return s.attributes if s.error is None else {**s.attributes, "error.type": s.error}


# -- protobuf: filled in place (a message passed to a constructor is copied: 3x slower) -------------------------

def _set_value(target: Any, v: AttrValue) -> None:
    # the exporter's _encode_value, by exact type first (the common case, and cheaper than isinstance chains)
    kind = type(v)
    if kind is str:
        target.string_value = v
    elif kind is int:
        target.int_value = v
    elif kind is bool:
        target.bool_value = v
    elif kind is float:
        target.double_value = v
    elif isinstance(v, bool):  # subclasses, in the exporter's order: a bool is an int, a str is a sequence
        target.bool_value = v
    elif isinstance(v, str):
        target.string_value = v
    elif isinstance(v, int):
        target.int_value = v
    elif isinstance(v, float):
        target.double_value = v
    else:
        values = target.array_value.values
        for x in v:
            _set_value(values.add(), x)


def _set_attributes(target: Any, attributes: Mapping[str, AttrValue]) -> None:
    add = target.add
    for k, v in attributes.items():
        _set_value(add(key=k).value, v)


def request(traces: Iterable[TraceRecord]) -> Any:
    """An ``ExportTraceServiceRequest`` (opentelemetry-proto) of ``traces``: one ``ResourceSpans`` each."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    out = ExportTraceServiceRequest()
    for trace in traces:
        rs = out.resource_spans.add()
        _set_attributes(rs.resource.attributes, trace.resource)
        ss = rs.scope_spans.add()
        ss.scope.name = SCOPE
        spans = ss.spans
        trace_id = trace.trace_id.to_bytes(16, "big")
        for s in trace.spans:
            span = spans.add(trace_id=trace_id, span_id=s.span_id.to_bytes(8, "big"), flags=_FLAGS, name=s.name,
                             kind=_kind(s), start_time_unix_nano=_ns(s.start), end_time_unix_nano=_ns(s.end))
            if s.parent_id is not None:
                span.parent_span_id = s.parent_id.to_bytes(8, "big")
            _set_attributes(span.attributes, _with_error(s))
            for e in s.events:
                _set_attributes(span.events.add(name=e.name, time_unix_nano=_ns(e.ts)).attributes, e.attributes)
            span.status.SetInParent()  # the exporter's encoder always sets it: UNSET is an empty status
            if s.error is not None:
                span.status.code = _ERROR
                span.status.message = s.error_message or s.error
    return out


# -- proto-json: its generated dataclasses, whose to_dict is OTLP's JSON -------------------------------------------

class _JsonBuilder:
    def __init__(self) -> None:
        from opentelemetry.proto_json.common.v1 import common
        from opentelemetry.proto_json.trace.v1 import trace

        self.AnyValue, self.ArrayValue, self.KeyValue = common.AnyValue, common.ArrayValue, common.KeyValue
        self.Span, self.Event, self.Status = trace.Span, trace.Span.Event, trace.Status
        # the (key, value) pairs that recur on every span of a kind (operation, model, job, tool names) are built
        # once per trace; a message shared between spans is only read, never changed
        self.pairs: dict[tuple[str, type, Any], Any] = {}
        self.unset = self.Status()

    def value(self, v: AttrValue) -> Any:
        if isinstance(v, bool):
            return self.AnyValue(bool_value=v)
        if isinstance(v, str):
            return self.AnyValue(string_value=v)
        if isinstance(v, int):
            return self.AnyValue(int_value=v)
        if isinstance(v, float):
            return self.AnyValue(double_value=v)
        return self.AnyValue(array_value=self.ArrayValue(values=[self.value(x) for x in v]))

    def attributes(self, attributes: Mapping[str, AttrValue]) -> list[Any]:
        out = []
        pairs = self.pairs
        for k, v in attributes.items():
            key = (k, type(v), v if isinstance(v, (str, int, float)) else tuple(v))
            kv = pairs.get(key)
            if kv is None:
                kv = pairs[key] = self.KeyValue(key=k, value=self.value(v))
            out.append(kv)
        return out

    def span(self, trace_id: bytes, s: SpanRecord) -> Any:
        status = self.unset
        if s.error is not None:
            status = self.Status(code=_ERROR, message=s.error_message or s.error)
        return self.Span(
            trace_id=trace_id, span_id=s.span_id.to_bytes(8, "big"),
            parent_span_id=s.parent_id.to_bytes(8, "big") if s.parent_id is not None else None,
            flags=_FLAGS, name=s.name, kind=_kind(s), start_time_unix_nano=_ns(s.start),
            end_time_unix_nano=_ns(s.end), attributes=self.attributes(_with_error(s)),
            events=[self.Event(name=e.name, time_unix_nano=_ns(e.ts), attributes=self.attributes(e.attributes))
                    for e in s.events] or None,
            status=status)


def traces_data_json(trace: TraceRecord) -> Any:
    """The trace as an opentelemetry-proto-json ``TracesData``: its ``to_dict()`` is a line of OTLP JSON."""
    from opentelemetry.proto_json.common.v1.common import InstrumentationScope
    from opentelemetry.proto_json.resource.v1.resource import Resource
    from opentelemetry.proto_json.trace.v1.trace import ResourceSpans, ScopeSpans, TracesData

    b = _JsonBuilder()
    trace_id = trace.trace_id.to_bytes(16, "big")
    return TracesData(resource_spans=[ResourceSpans(
        resource=Resource(attributes=b.attributes(trace.resource)),
        scope_spans=[ScopeSpans(scope=InstrumentationScope(name=SCOPE),
                                spans=[b.span(trace_id, s) for s in trace.spans])])])


def post(exporter: Any, traces: Sequence[TraceRecord]) -> bool:
    """Post the spans of ``traces`` as one OTLP/HTTP request with ``exporter`` (an ``OTLPSpanExporter``); True when
    the collector took them.

    The exporter's ``export`` takes only SDK spans, which it encodes again; its HTTP client (the endpoint, the
    ``OTEL_EXPORTER_OTLP_*`` headers, compression and TLS it was configured with, its retries) posts the request
    built here.  That client is the exporter's ``_client`` (opentelemetry-exporter-otlp-proto-http 1.45); an
    exporter without one is given the SDK's spans, the same request encoded its own way."""
    client = getattr(exporter, "_client", None)
    if client is None or not callable(getattr(client, "export", None)):
        from opentelemetry.sdk.trace.export import SpanExportResult

        return bool(exporter.export([s for t in traces for s in sdk_spans(t)]) is SpanExportResult.SUCCESS)
    return bool(client.export(request(traces).SerializeToString()).success)


def sdk_spans(trace: TraceRecord) -> list[ReadableSpan]:
    """The trace's spans as the SDK's ``ReadableSpan``s: ids, parents, times and statuses as recorded (for an
    exporter without the client :func:`post` uses, for code that hands them to another exporter, and for the test
    that compares :func:`request` with the exporter's own ``encode_spans`` of them)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    resource = Resource(dict(trace.resource))
    scope = InstrumentationScope(SCOPE)
    flags = TraceFlags(TraceFlags.SAMPLED)
    out: list[ReadableSpan] = []
    for s in trace.spans:
        parent = (SpanContext(trace.trace_id, s.parent_id, is_remote=False, trace_flags=flags)
                  if s.parent_id is not None else None)
        status = Status(StatusCode.UNSET)
        if s.error is not None:
            status = Status(StatusCode.ERROR, s.error_message or s.error)
        out.append(ReadableSpan(
            name=s.name, context=SpanContext(trace.trace_id, s.span_id, is_remote=False, trace_flags=flags),
            parent=parent, resource=resource, attributes=dict(_with_error(s)),
            events=[Event(e.name, dict(e.attributes), _ns(e.ts)) for e in s.events],
            kind=SpanKind.CLIENT if s.kind == "client" else SpanKind.INTERNAL, status=status,
            start_time=_ns(s.start), end_time=_ns(s.end), instrumentation_scope=scope))
    return out
