"""The gallery's FastAPI app: fastapi-idempotency-key's `IdempotencyMiddleware` with its
`MemoryBackend`, added as its README's Quick Start says (header Idempotency-Key, a 24 h TTL,
every other option at its default), in front of the payments handler of payments.py, with
authentication as a FastAPI dependency of the route. Served by uvicorn, one worker.

    python3 examples/peers/fastapi_app.py --port 0
"""
import argparse
import asyncio
import socket

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi_idempotency_key import IdempotencyMiddleware, MemoryBackend

import payments

app = FastAPI(title="Payment API")
app.add_middleware(
    IdempotencyMiddleware,
    backend=MemoryBackend(),
    header_name="Idempotency-Key",
    default_ttl=86400,
)


def authenticated(request: Request) -> str:
    acct = payments.account(request.headers.get("Authorization"))
    if acct is None:
        raise HTTPException(status_code=401, detail="unknown token")
    return acct


@app.post("/payments")
async def create_payment(request: Request, acct: str = Depends(authenticated)):
    try:
        body = await request.json()
    except ValueError:
        return JSONResponse({"error": "the body is not JSON"}, status_code=400)
    error = payments.validate(body)
    if error:
        return JSONResponse({"error": error}, status_code=400)
    await asyncio.sleep(payments.PROVIDER_DELAY)
    status, value = payments.charge(acct, body)
    return JSONResponse(value, status_code=status)


@app.get("/payments/{payment_id}")
async def show_payment(payment_id: str, acct: str = Depends(authenticated)):
    status, value = payments.show(acct, payment_id)
    return JSONResponse(value, status_code=status)


@app.get("/healthz")
async def healthz():
    return {"status": "ok"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    # Bound here so that port 0 works and the port is printed before uvicorn takes over.
    sock = socket.socket()
    sock.bind(("127.0.0.1", parser.parse_args().port))
    host, port = sock.getsockname()
    print(f"listening on http://{host}:{port}", flush=True)
    config = uvicorn.Config(app, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])
