"""Test helpers: real HTTP servers on loopback (the sandbox, a recording chat sink)."""

from __future__ import annotations

import threading

from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from tests.servers import free_port


class LoopbackServer:
    """Serve a WSGI app on 127.0.0.1 in a background thread."""

    def __init__(self, app):
        self.port = free_port()
        self.server = make_server("127.0.0.1", self.port, app, threaded=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.thread.join(5)


class RecordingSink:
    """A Slack-compatible incoming webhook that records what it accepts; `up=False` answers 503."""

    def __init__(self):
        self.up = True
        self.received: list[bytes] = []

    def __call__(self, environ, start_response):
        request = Request(environ)
        if not self.up:
            return Response("down", status=503)(environ, start_response)
        self.received.append(request.get_data())
        return Response("ok")(environ, start_response)
