"""A Stripe-shaped upstream for scripts/stripe_sdks.sh: POST /v1/charges answers a charge.

Stripe's SDKs send form-encoded bodies and expect a JSON object with `id` and `object`, and a
`Request-Id` header. A charge whose `description` is `hold` is held until the test posts to
/__release?key=KEY (its Idempotency-Key, which the gateway forwards), so a duplicate sent
meanwhile finds its key in use at the gateway. /__calls?key=KEY says how many charges with that
key reached this upstream (the gateway must send one) and whether one is being held.
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

lock = threading.Lock()
charges = 0
calls = {}  # Idempotency-Key -> charges that reached us with it
held = {}  # Idempotency-Key -> released (an Event) for a charge being held


class Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, status, body, headers=()):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def target(self):
        url = urlsplit(self.path)
        return url.path, parse_qs(url.query).get("key", [""])[0]

    def do_GET(self):
        path, key = self.target()
        if path == "/__calls":
            with lock:
                self.answer(200, {"calls": calls.get(key, 0), "held": key in held})
        else:
            self.answer(404, {"error": {"type": "invalid_request_error", "message": "no such path"}})

    def do_POST(self):
        global charges
        length = int(self.headers.get("Content-Length", "0"))
        form = parse_qs(self.rfile.read(length).decode())
        path, key = self.target()
        if path == "/__release":
            with lock:
                released = held.pop(key, None)
            if released:
                released.set()
            self.answer(200, {"released": released is not None})
            return
        if path != "/v1/charges":
            self.answer(404, {"error": {"type": "invalid_request_error", "message": "no such path"}})
            return
        key = self.headers.get("Idempotency-Key", "")
        released = threading.Event()
        with lock:
            charges += 1
            number = charges
            calls[key] = calls.get(key, 0) + 1
            if form.get("description") == ["hold"]:
                held[key] = released
        if form.get("description") == ["hold"] and not released.wait(60):
            with lock:
                held.pop(key, None)
        self.answer(
            200,
            {
                "id": f"ch_{number:06d}",
                "object": "charge",
                "amount": int(form.get("amount", ["0"])[0]),
                "currency": form.get("currency", ["usd"])[0],
                "description": form.get("description", [None])[0],
            },
            [("Request-Id", f"req_{number:06d}")],
        )


server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
print(f"upstream listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
server.serve_forever()
