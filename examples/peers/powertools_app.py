"""The gallery's AWS Lambda Powertools app: a Lambda handler with Powertools' `@idempotent` and
its Redis persistence (`CachePersistenceLayer`), configured as Powertools' documentation shows
for an idempotency key in an HTTP header (`event_key_jmespath='headers."idempotency-key"'`),
every other option at its default; with POWERTOOLS_PAYLOAD_VALIDATION=1, also the documented
payload validation on the body (`payload_validation_jmespath="body"`). In front of the
payments handler of payments.py.

Lambda has no HTTP server of its own, so a small wrapper stands in for API Gateway: it
authenticates the bearer token (as an authorizer does, before the function), passes an HTTP
API-style event (header names in lower case, the body as a string, the account in
requestContext.authorizer) with a Lambda context whose remaining time is 30 s, and answers what
the function returns. Powertools raises where a response is not the function's own; the wrapper
maps those the draft's way: IdempotencyAlreadyInProgressError -> 409, IdempotencyValidationError
-> 422, any other exception (a failed payment) -> 500, which Powertools does not store.

    REDIS_URL=redis://127.0.0.1:6379/13 [POWERTOOLS_PAYLOAD_VALIDATION=1] \
        python3 examples/peers/powertools_app.py --port 0
"""
import argparse
import json
import os
import time

from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent
from aws_lambda_powertools.utilities.idempotency.exceptions import (
    IdempotencyAlreadyInProgressError,
    IdempotencyValidationError,
)
from aws_lambda_powertools.utilities.idempotency.persistence.cache import CachePersistenceLayer

import payments
from httpjson import JsonHandler, serve

persistence_layer = CachePersistenceLayer(url=os.environ["REDIS_URL"])
if os.environ.get("POWERTOOLS_PAYLOAD_VALIDATION") == "1":
    config = IdempotencyConfig(
        event_key_jmespath='headers."idempotency-key"',
        payload_validation_jmespath="body",
    )
else:
    config = IdempotencyConfig(event_key_jmespath='headers."idempotency-key"')


class PaymentError(Exception):
    """The provider failed: raised, so that Powertools deletes the record and a retry runs."""


@idempotent(config=config, persistence_store=persistence_layer)
def lambda_handler(event, context):
    acct = event["requestContext"]["authorizer"]["principalId"]
    try:
        body = json.loads(event.get("body") or "null")
    except ValueError:
        return {"statusCode": 400, "body": json.dumps({"error": "the body is not JSON"})}
    error = payments.validate(body)
    if error:
        return {"statusCode": 400, "body": json.dumps({"error": error})}
    time.sleep(payments.PROVIDER_DELAY)
    status, value = payments.charge(acct, body)
    if status >= 500:
        raise PaymentError(value["error"])
    return {
        "statusCode": status,
        "headers": {"Content-Type": "application/json", "Location": f"/payments/{value['id']}"},
        "body": json.dumps(value),
    }


class LambdaContext:
    """What the function's context offers that Powertools reads."""

    function_name = "payments"
    memory_limit_in_mb = 128
    invoked_function_arn = "arn:aws:lambda:local:000000000000:function:payments"
    aws_request_id = "local"

    def __init__(self):
        self._deadline = time.monotonic() + 30

    def get_remaining_time_in_millis(self):
        return max(0, int((self._deadline - time.monotonic()) * 1000))


class Gateway(JsonHandler):
    """The stand-in for API Gateway."""

    def do_POST(self):
        raw = self.body_bytes()
        if self.path != "/payments":
            return self.answer(404, {"error": "no such route"})
        acct = payments.account(self.headers.get("Authorization"))
        if acct is None:
            return self.answer(401, {"message": "Unauthorized"})
        event = {
            "version": "2.0",
            "routeKey": "POST /payments",
            "rawPath": self.path,
            "headers": {name.lower(): value for name, value in self.headers.items()},
            "body": raw.decode("utf-8", "replace"),
            "isBase64Encoded": False,
            "requestContext": {"authorizer": {"principalId": acct}},
        }
        try:
            result = lambda_handler(event, LambdaContext())
        except IdempotencyAlreadyInProgressError as e:
            return self.answer(409, {"error": str(e)})
        except IdempotencyValidationError as e:
            return self.answer(422, {"error": str(e)})
        except Exception as e:  # noqa: BLE001 - a function error, as API Gateway answers it
            return self.answer(500, {"error": str(e)})
        self.answer(
            result.get("statusCode", 200),
            (result.get("body") or "").encode(),
            {k: v for k, v in (result.get("headers") or {}).items() if k != "Content-Type"},
        )

    def do_GET(self):
        if self.path == "/healthz":
            return self.answer(200, {"status": "ok"})
        if self.path.startswith("/payments/"):
            acct = payments.account(self.headers.get("Authorization"))
            if acct is None:
                return self.answer(401, {"message": "Unauthorized"})
            return self.answer(*payments.show(acct, self.path[len("/payments/"):]))
        self.answer(404, {"error": "no such route"})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    serve(Gateway, parser.parse_args().port)
