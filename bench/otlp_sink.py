"""An OTLP/HTTP receiver that takes span batches and drops them, in a process of its own.

`sluice bench kafka` measures what tracing costs a worker; the collector belongs on
another machine in a deployment, so here it is the cheapest thing that answers as
one does (200 to every POST of /v1/traces), outside the bench's interpreter and GIL.
It counts what it received and says so on stderr when it stops.

    python -m bench.otlp_sink PORT
"""

from __future__ import annotations

import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar


class _Receiver(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as collectors answer
    received: ClassVar[list[int]] = [0, 0]  # requests, bytes

    def do_POST(self) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(size)
        _Receiver.received[0] += 1
        _Receiver.received[1] += size
        ok = self.path.rstrip("/").endswith("/v1/traces")
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        return None


def main() -> None:
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # the server's threads inherit this
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print("ready", flush=True)
    signal.sigwait(stop)
    server.shutdown()
    requests_, size = _Receiver.received
    print(f"otlp sink: {requests_} exports, {size} bytes", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
