"""An S3 endpoint in front of a real one that refuses what a test names: 403 AccessDenied for the
buckets in `denied` (their listings, or everything), the real endpoint's answer otherwise. For the
answers a caller gets when S3 says no (no s3:ListBucket, a bucket of someone else's)."""

from __future__ import annotations

import http.server
import socketserver
import threading
import urllib.error
import urllib.request

_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied</Message><RequestId>test</RequestId></Error>"
)


_HOP_BY_HOP = ("content-length", "transfer-encoding", "connection", "date", "server")


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


class S3Refuser:
    def __init__(self, upstream: str, denied: set[str]) -> None:
        refuser = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: object) -> None:
                pass

            def handle_any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.path.lstrip("/").split("/")[0].split("?")[0] in refuser.denied:
                    self._answer(403, {"Content-Type": "application/xml"}, _DENIED)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                request = urllib.request.Request(upstream + self.path, body, headers, method=self.command)
                try:
                    with urllib.request.urlopen(request, timeout=30) as reply:
                        self._answer(reply.status, dict(reply.headers), reply.read())
                except urllib.error.HTTPError as exc:
                    self._answer(exc.code, dict(exc.headers), exc.read())

            def _answer(self, status: int, headers: dict[str, str], data: bytes) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    if name.lower() not in (
                        "content-length",
                        "transfer-encoding",
                        "connection",
                        "date",
                        "server",
                    ):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = handle_any

        self.denied = denied
        self.server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, name="s3-refuser", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
