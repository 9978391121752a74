"""The gallery's Django app: django-idempotency-key's `IdempotencyKeyMiddleware` in MIDDLEWARE,
as its README says (every non-safe method needs a key), with its default settings (in-memory
storage, a thread lock, CONFLICT_STATUS_CODE 409), in front of the payments handler of
payments.py. One process, one thread per request, as `manage.py runserver` serves.

    python3 examples/peers/django_app.py --port 0
"""
import argparse
import json
import time

from django.conf import settings

settings.configure(
    DEBUG=False,
    SECRET_KEY="idem-gallery-not-a-secret",
    ALLOWED_HOSTS=["127.0.0.1", "localhost"],
    ROOT_URLCONF=__name__,
    MIDDLEWARE=["idempotency_key.middleware.IdempotencyKeyMiddleware"],
    INSTALLED_APPS=[],
)

import django  # noqa: E402

django.setup()

from django.http import JsonResponse  # noqa: E402
from django.urls import path  # noqa: E402

import payments  # noqa: E402


def create_payment(request):
    if request.method != "POST":
        return JsonResponse({"error": "method not allowed"}, status=405)
    acct = payments.account(request.headers.get("Authorization"))
    if acct is None:
        return JsonResponse({"error": "unknown token"}, status=401)
    try:
        body = json.loads(request.body or b"null")
    except ValueError:
        return JsonResponse({"error": "the body is not JSON"}, status=400)
    error = payments.validate(body)
    if error:
        return JsonResponse({"error": error}, status=400)
    time.sleep(payments.PROVIDER_DELAY)
    status, value = payments.charge(acct, body)
    return JsonResponse(value, status=status)


def show_payment(request, payment_id):
    acct = payments.account(request.headers.get("Authorization"))
    if acct is None:
        return JsonResponse({"error": "unknown token"}, status=401)
    status, value = payments.show(acct, payment_id)
    return JsonResponse(value, status=status)


def healthz(request):
    return JsonResponse({"status": "ok"})


urlpatterns = [
    path("payments", create_payment),
    path("payments/<str:payment_id>", show_payment),
    path("healthz", healthz),
]


if __name__ == "__main__":
    from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler
    from django.core.wsgi import get_wsgi_application

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    # What runserver runs, bound here so that port 0 works and the port is printed.
    server = ThreadedWSGIServer(("127.0.0.1", parser.parse_args().port), WSGIRequestHandler)
    server.set_app(get_wsgi_application())
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port}", flush=True)
    server.serve_forever()
