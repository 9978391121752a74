"""The payments handler with no idempotency at all: every POST is a new payment.

The gallery's baseline row, and the upstream `idem proxy` is put in front of.

    python3 examples/peers/plain.py --port 0
"""
import argparse
import json
import time

import payments
from httpjson import JsonHandler, serve


class Api(JsonHandler):
    def do_POST(self):
        if self.path != "/payments":
            return self.answer(404, {"error": "no such route"})
        raw = self.body_bytes()
        acct = payments.account(self.headers.get("Authorization"))
        if acct is None:
            return self.answer(401, {"error": "unknown token"})
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            return self.answer(400, {"error": "the body is not JSON"})
        error = payments.validate(body)
        if error:
            return self.answer(400, {"error": error})
        time.sleep(payments.PROVIDER_DELAY)
        status, value = payments.charge(acct, body)
        headers = {"Location": f"/payments/{value['id']}"} if status == 201 else None
        self.answer(status, value, headers)

    def do_GET(self):
        if self.path == "/healthz":
            return self.answer(200, {"status": "ok"})
        if self.path.startswith("/payments/"):
            acct = payments.account(self.headers.get("Authorization"))
            if acct is None:
                return self.answer(401, {"error": "unknown token"})
            return self.answer(*payments.show(acct, self.path[len("/payments/"):]))
        self.answer(404, {"error": "no such route"})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    serve(Api, parser.parse_args().port)
