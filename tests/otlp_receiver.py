"""A loopback OTLP/HTTP receiver for the OpenTelemetry tests: each POST's path, headers and decoded
``ExportTraceServiceRequest`` (real protobuf over real HTTP), answering ``status`` after ``delay`` seconds."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

__all__ = ["Receiver"]


@dataclass
class Receiver:
    """A loopback OTLP/HTTP receiver: each POST's path, headers and decoded ExportTraceServiceRequest."""

    status: int = 200
    delay: float = 0.0
    got: list[tuple[str, dict[str, str], ExportTraceServiceRequest]] = field(default_factory=list)

    def __post_init__(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.got.append((self.path, {k.lower(): v for k, v in self.headers.items()}, request))
                if receiver.delay:
                    time.sleep(receiver.delay)
                try:
                    self.send_response(receiver.status)
                    self.send_header("Content-Type", "application/x-protobuf")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:  # the client gave up waiting (a slow collector)
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self) -> list[Span]:
        """Every span received so far, in the order received (a span sent twice is there twice)."""
        return [s for _, _, r in list(self.got) for rs in r.resource_spans
                for ss in rs.scope_spans for s in ss.spans]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
