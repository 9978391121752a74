"""A small JSON HTTP server for the gallery apps that have no framework of their own (the plain
upstream, the Powertools wrapper): one thread per request, the listening address printed as
`listening on http://HOST:PORT` once bound (port 0: the kernel picks).
"""
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JsonHandler(BaseHTTPRequestHandler):
    """Reads JSON bodies and writes JSON answers; subclasses route."""

    protocol_version = "HTTP/1.1"

    def body_bytes(self):
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def answer(self, status, value, headers=None):
        data = value if isinstance(value, bytes) else json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, content in (headers or {}).items():
            self.send_header(name, content)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def serve(handler, port):
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    host, bound = server.server_address[:2]
    print(f"listening on http://{host}:{bound}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        sys.exit(0)
