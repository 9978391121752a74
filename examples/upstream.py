"""A payments API that knows nothing of idempotency: every POST is new work.

The upstream of README's `idem proxy` sessions. Each route counts what it did, so a session can
show what reached it:

- POST /charges          a new charge per call, 0.2 s each (as a real provider takes), so copies
                         sent at once meet the first one in flight: 201 {"id": "ch_N", ...}
- POST /webhooks/github  handles a GitHub delivery (X-GitHub-Delivery names it)
- POST /webhooks/stripe  handles a Stripe event (its body's "id" names it)
- POST /search           a query, which has no effect to protect
- GET  /stats            how many times each route ran

    python3 examples/upstream.py                         # http://127.0.0.1:3000
    python3 examples/upstream.py --port 3443 --tls-cert server.pem --tls-key server.key
"""
import argparse
import json
import ssl
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ran = Counter()
lock = threading.Lock()


def count(route):
    with lock:
        ran[route] += 1
        return ran[route]


class Api(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/charges":
            time.sleep(0.2)
            n = count("charges")
            self.answer(201, {"id": f"ch_{n}", "charged": body.get("amount")},
                        {"Request-Id": f"req_{n}"})
        elif self.path == "/webhooks/github":
            n = count("github deliveries")
            self.answer(200, {"handled": self.headers.get("X-GitHub-Delivery"), "times": n})
        elif self.path == "/webhooks/stripe":
            n = count("stripe events")
            self.answer(200, {"handled": body.get("id"), "times": n})
        elif self.path == "/search":
            n = count("searches")
            self.answer(200, {"results": [], "query": body.get("q"), "times": n})
        else:
            self.answer(404, {"error": "no such route"})

    def do_GET(self):
        if self.path == "/stats":
            with lock:
                self.answer(200, dict(ran))
        else:
            self.answer(404, {"error": "no such route"})

    def answer(self, status, value, headers=None):
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, header in (headers or {}).items():
            self.send_header(name, header)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_):
        pass  # the session shows what reached the API through /stats


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--port", type=int, default=3000)
parser.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
parser.add_argument("--tls-key", help="the private key of --tls-cert (PEM)")
args = parser.parse_args()

server = ThreadingHTTPServer(("127.0.0.1", args.port), Api)
if args.tls_cert:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(args.tls_cert, args.tls_key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
