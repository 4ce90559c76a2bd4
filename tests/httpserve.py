"""A file server on 127.0.0.1 for the URL tests: HTTP/1.1 with byte ranges (``Range:
bytes=a-b``, which the standard library's SimpleHTTPRequestHandler ignores), an ETag and
Last-Modified from each file's size and mtime, and a count of the body bytes it sends per
file, so that a test can say what fraction of a slide a command fetched.

    with serve(folder) as server:
        url = server.url("slide.tif")
        ...
        server.sent["slide.tif"]  # body bytes sent for it
"""

from __future__ import annotations

import contextlib
import email.utils
import os
import re
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: aiohttp reuses the connection, as with a real server
    server: _Server

    def log_message(self, *args) -> None:  # quiet
        pass

    def _file(self) -> Path | None:
        name = unquote(urlsplit(self.path).path).lstrip("/")
        path = (self.server.root / name).resolve()
        if self.server.root not in path.parents or not path.is_file():
            return None
        return path

    def _headers(self, path: Path, status: int, length: int, extra: dict[str, str]) -> None:
        st = path.stat()
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        if self.server.validators:
            self.send_header("ETag", f'"{st.st_size:x}-{st.st_mtime_ns:x}"')
            self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        for k, v in extra.items():
            self.send_header(k, v)
        self.end_headers()

    def _missing(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
        path = self._file()
        if path is None:
            return self._missing()
        self._headers(path, 200, path.stat().st_size, {})

    def do_GET(self) -> None:  # noqa: N802
        path = self._file()
        if path is None:
            return self._missing()
        size = path.stat().st_size
        start, end, status, extra = 0, size - 1, 200, {}
        m = _RANGE.match(self.headers.get("Range", "").strip())
        if m and (m[1] or m[2]):
            if m[1]:
                start, end = int(m[1]), min(int(m[2]) if m[2] else size - 1, size - 1)
            else:  # the last N bytes
                start = max(0, size - int(m[2]))
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status, extra = 206, {"Content-Range": f"bytes {start}-{end}/{size}"}
        n = end - start + 1
        self._headers(path, status, n, extra)
        with open(path, "rb") as fh:
            fh.seek(start)
            data = fh.read(n)
        self.wfile.write(data)
        with self.server.lock:
            self.server.sent[path.relative_to(self.server.root).as_posix()] += len(data)
            self.server.requests += 1


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path, validators: bool):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = Path(root).resolve()
        self.validators = validators
        self.sent: Counter[str] = Counter()
        self.requests = 0
        self.lock = threading.Lock()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{name}"

    def reset(self) -> None:
        with self.lock:
            self.sent.clear()
            self.requests = 0


@contextlib.contextmanager
def serve(root: str | os.PathLike[str], *, validators: bool = True) -> Iterator[_Server]:
    """Serve the files under ``root`` on 127.0.0.1 (a free port) for the ``with`` block;
    ``validators``: send ETag and Last-Modified (a server that sends neither: False)."""
    server = _Server(Path(root), validators)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
