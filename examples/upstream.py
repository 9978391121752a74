"""A payments API that knows nothing of idempotency: every POST is a new charge.

The upstream of README's `idem proxy` session. It takes a moment per charge, as a real
provider does, so copies sent at once meet the first one in flight. Listens on 127.0.0.1:3000.
"""
import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

charges = 0


class Charges(BaseHTTPRequestHandler):
    def do_POST(self):
        global charges
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        time.sleep(0.2)
        charges += 1
        answer = json.dumps({"id": f"ch_{charges}", "charged": body.get("amount")}).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)


ThreadingHTTPServer(("127.0.0.1", 3000), Charges).serve_forever()
