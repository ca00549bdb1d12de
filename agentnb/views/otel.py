"""Jobs as OpenTelemetry GenAI traces: a file of OTLP JSON Lines, or OTLP/HTTP to a collector (docs/otel.md).

The mapping (which span, event and attribute each part of a job becomes) is :mod:`agentnb.views._otel_spans`;
:mod:`agentnb.views._otel_encode` builds the OTLP messages from its records with the OpenTelemetry packages'
message classes: ``opentelemetry-proto``'s protobuf messages, which the OTLP/HTTP exporter's client posts, and
``opentelemetry-proto-json``'s, whose encoding is OTLP's JSON (one ``TracesData`` per line: the file exporter's
format).  The packages are the ``agentnb[otel]`` extra; without it an export stops with one line saying what to
install.

OTLP's JSON differs from protobuf's own JSON mapping in two ways (the OTLP specification, "JSON Protobuf
Encoding"): trace and span ids are hex strings, not base64, and enums are integers.  :func:`traces_json`
writes it so and :func:`read_traces` reads it back into protobuf ``TracesData`` with ``json_format``.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._fs import file_in_the_way, special_kind
from ..errors import AgentnbError, UsageError
from ..store.base import Store
from ..store.records import JobRecord
from ._otel_encode import post, request, sdk_spans, traces_data_json
from ._otel_spans import DEFAULT_MAX_CHARS, TraceRecord, store_identity, trace_of

if TYPE_CHECKING:
    from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

__all__ = ["DEFAULT_MAX_CHARS", "INSTALL_HINT", "MIN_CHARS", "CollectorError", "check_content", "check_headers",
           "export_otel", "read_traces", "root_jobs", "sdk_spans", "send_otel", "traces", "traces_data", "traces_json",
           "traces_url"]

INSTALL_HINT = "OpenTelemetry export needs the otel extra: pip install 'agentnb[otel]'"
_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


class CollectorError(AgentnbError, RuntimeError):
    """A collector did not take the spans sent to it (unreachable, or it answered with an error)."""


def _require() -> None:
    for module in ("opentelemetry.sdk.trace", "opentelemetry.proto.trace.v1.trace_pb2",
                   "opentelemetry.proto_json.trace.v1.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package missing
            found = False
        if not found:
            raise UsageError(INSTALL_HINT)


def root_jobs(store: Store, jobs: Iterable[int]) -> list[JobRecord]:
    """The root jobs of ``jobs`` (a subtask's trace is its root's), each once, in the order first named."""
    roots: dict[int, JobRecord] = {}
    for job_id in jobs:
        record = store.job(job_id)
        seen = {record.id}
        while record.parent_id is not None and record.parent_id not in seen:
            record = store.job(record.parent_id)
            seen.add(record.id)
        roots.setdefault(record.id, record)
    return list(roots.values())


MIN_CHARS = 100  # the smallest max_chars: a message list cut to its marks still fits


def check_content(content: Any, max_chars: Any) -> None:
    """``content`` and ``max_chars`` of an export checked: one line naming what is allowed (a string is no
    switch: ``content="no"`` would send the messages)."""
    if not isinstance(content, bool):
        raise UsageError(f"content={content!r}; allowed: True (send messages, tool arguments and results, scrubbed) "
                         "or False (the default)")
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < MIN_CHARS:
        raise UsageError(f"max_chars={max_chars!r}; allowed: a whole number of characters ≥ {MIN_CHARS} "
                         f"(default {DEFAULT_MAX_CHARS})")


def traces(store: Store, jobs: Iterable[int], *, content: bool = False,
           max_chars: int = DEFAULT_MAX_CHARS) -> Iterator[TraceRecord]:
    """The trace of each root job of ``jobs`` (docs/otel.md#mapping)."""
    check_content(content, max_chars)
    identity = store_identity(store)
    for root in root_jobs(store, jobs):
        yield trace_of(store, root, content=content, max_chars=max_chars, identity=identity)


def traces_data(trace: TraceRecord) -> TracesData:
    """One trace as an OTLP ``TracesData`` protobuf message (the one the exporter's ``encode_spans`` gives)."""
    from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

    return TracesData(resource_spans=request([trace]).resource_spans)


def _spans_json(data: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The spans of a ``TracesData`` in protobuf's JSON (dicts), and their links: the objects holding ids."""
    for rs in data.get("resourceSpans", ()):
        for scope_spans in rs.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                yield span
                yield from span.get("links", ())


def _recode_ids(data: dict[str, Any], recode: Callable[[str], str]) -> None:
    # protobuf's JSON gives bytes as base64; OTLP's JSON wants the ids as hex (and reading back, the reverse)
    for holder in _spans_json(data):
        for key in _ID_FIELDS:
            if key in holder:
                holder[key] = recode(holder[key])


def _to_base64(text: str) -> str:
    return base64.b64encode(bytes.fromhex(text)).decode("ascii")


def traces_json(trace: TraceRecord) -> str:
    """One line of OTLP JSON: the trace's ``TracesData``, ids in hex and enums as integers (by
    ``opentelemetry-proto-json``, whose messages encode OTLP's JSON; protobuf's ``json_format`` was 3× slower)."""
    return json.dumps(traces_data_json(trace).to_dict(), ensure_ascii=False, separators=(",", ":"))


def read_traces(path: str | os.PathLike[str]) -> list[TracesData]:
    """The ``TracesData`` of each line of an OTLP JSON Lines file (hex ids read as OTLP's JSON says)."""
    _require()
    from google.protobuf import json_format
    from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            data = json.loads(line)
            _recode_ids(data, _to_base64)
            out.append(json_format.ParseDict(data, TracesData()))
    return out


def export_otel(store: Store, jobs: Sequence[int], path: str | os.PathLike[str], *, content: bool = False,
                max_chars: int = DEFAULT_MAX_CHARS) -> Path:
    """Write the traces of ``jobs`` (their root jobs', subtasks nested) to ``path`` as OTLP JSON Lines, one
    ``TracesData`` per root job; return the file.  Written whole or not at all."""
    _require()
    check_content(content, max_chars)
    if not jobs:
        raise UsageError("nothing to export: name at least one job (or a batch with jobs)")
    target = _export_target(store, path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for trace in traces(store, jobs, content=content, max_chars=max_chars):
                f.write(traces_json(trace))
                f.write("\n")
        os.replace(tmp, target)  # a reader never sees half a file
    finally:
        tmp.unlink(missing_ok=True)
    return target.resolve()


_SQLITE_HEADER = b"SQLite format 3\x00"


def _export_target(store: Store, path: str | os.PathLike[str]) -> Path:
    """The file an export writes, checked before anything is made: never a folder, a device or a pipe, the
    store or its companion files, nor any SQLite database (an export replaces the file it is given)."""
    text = os.fspath(path)
    if not str(text).strip():
        raise UsageError("the file to write is empty; give a path, e.g. traces.jsonl")
    target = Path(text).expanduser()
    if target.is_dir():
        raise UsageError(f"{text}: is a folder; give the file to write, e.g. {target / 'traces.jsonl'}")
    if str(text).endswith(("/", os.sep)):
        raise UsageError(f"{text}: ends with a slash but is no folder; give the file to write, e.g. "
                         f"{target / 'traces.jsonl'}")
    blocking = file_in_the_way(target)
    if blocking is not None:
        raise UsageError(f"{text}: {blocking} is a file, not a folder")
    target = target.resolve()  # a link: the file it points to is written, the link kept
    if target.exists() and not target.is_file():
        raise UsageError(f"{text}: is not a regular file but {special_kind(target.stat().st_mode)}; give a file "
                         "to write")
    store_file = Path(str(store.path)).expanduser()
    if store_file.exists():
        stem = store_file.resolve()
        if target == stem or (target.name.startswith(stem.name + "-") and target.parent == stem.parent):
            raise UsageError(f"{text}: is the store itself (or one of its files); give another file to write")
    if target.is_file():
        with target.open("rb") as f:
            if f.read(len(_SQLITE_HEADER)) == _SQLITE_HEADER:
                raise UsageError(f"{text}: is an SQLite database, which the export would replace; give another file")
    return target


def traces_url(base: str | None, environ: Mapping[str, str]) -> str | None:
    """Where spans are posted (docs/otel.md#exporting): ``base/v1/traces`` for a collector's base URL given; else
    the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` as it is (the OTLP exporter specification: a
    signal-specific URL is used as-is), else ``OTEL_EXPORTER_OTLP_ENDPOINT``/v1/traces; None when none is set."""
    where = "endpoint"
    if not base:
        for where in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
            base = environ.get(where, "").strip()
            if base:
                break
        else:
            return None
    if not base.lower().startswith(("http://", "https://")) or not _is_url(base):
        raise UsageError(f"{where} {base!r} must be an http:// or https:// URL with a host (and a port from 1 to "
                         "65535 if any), e.g. http://127.0.0.1:4318")
    return base if where == "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" else base.rstrip("/") + "/v1/traces"


def _is_url(text: str) -> bool:
    from urllib.parse import urlsplit

    if any(c.isspace() for c in text):
        return False
    try:
        parts = urlsplit(text)
        port = parts.port  # raises for a port that is not a number from 0 to 65535
    except ValueError:
        return False
    return bool(parts.hostname) and port != 0


_HEADER_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS")


def check_headers(environ: Mapping[str, str]) -> None:
    """The standard headers variable the exporter reads (the traces one, else the general one: the exporter
    specification), checked: ``key=value`` pairs separated by commas.  The exporter itself would log a warning and
    send no header at all (an API key silently missing)."""
    for name in _HEADER_VARIABLES:
        value = environ.get(name, "")
        if not value.strip():
            continue
        for item in value.split(","):
            key, sep, _ = item.partition("=")
            if item.strip() and (not sep or not key.strip()):
                raise UsageError(f"{name}: {item.strip()[:40]!r} is not a header; allowed: key=value pairs separated "
                                 "by commas (e.g. authorization=Bearer%20TOKEN,x-team=lab)")
        return


def send_otel(store: Store, jobs: Sequence[int], endpoint: str | None = None, *, content: bool = False,
              max_chars: int = DEFAULT_MAX_CHARS, timeout: float = 10.0) -> int:
    """Post the traces of ``jobs`` as OTLP/HTTP protobuf to ``endpoint``/v1/traces (None: the standard
    variables, :func:`traces_url`), headers from ``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, else
    ``OTEL_EXPORTER_OTLP_HEADERS``; return the spans sent."""
    _require()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    check_content(content, max_chars)
    if not jobs:
        raise UsageError("nothing to send: name at least one job (or a batch with jobs)")
    url = traces_url(endpoint, os.environ)
    if url is None:
        raise UsageError("no collector to send to: give --endpoint URL (e.g. http://127.0.0.1:4318) or set "
                         "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT")
    check_headers(os.environ)
    exporter = OTLPSpanExporter(endpoint=url, timeout=timeout)  # headers: the exporter reads the standard variables
    sent = 0
    # the exporter logs each retry; the failure is said once, below, as one line
    quiet = logging.getLogger("opentelemetry.exporter.otlp")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        for trace in traces(store, jobs, content=content, max_chars=max_chars):
            if not post(exporter, [trace]):
                raise CollectorError(f"the collector at {url} did not take the spans (unreachable, or it refused "
                                     f"them); {sent} spans were sent before")
            sent += len(trace.spans)
    finally:
        exporter.shutdown()
        quiet.setLevel(level)
    return sent
