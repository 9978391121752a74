-- idem's idempotency keys: one row per (account, key), holding the fingerprint of the request
-- that claimed the key and, once it finished, the response that every retry gets back.
--
-- Life of a row: a request claims its key ('in_progress', with a lease and a fencing token);
-- when it finishes, the holder of the current token stores the response ('completed'). A retry
-- with the same key and fingerprint replays that response. Once expires_at passes the key is
-- new again, and a background sweeper deletes such rows in small batches.
--
-- Times are written by the service from its own clock (Unix milliseconds), not by now(), so
-- every instance and every test agrees on what "expired" means.
CREATE TABLE idempotency_keys (
    -- The authenticated account; keys are scoped to it, never global.
    account_id       text        NOT NULL,
    -- The client's Idempotency-Key.
    idem_key         text        NOT NULL,
    -- SHA-256 over method, route, query, content type and canonical body: 32 bytes.
    request_hash     bytea       NOT NULL CHECK (octet_length(request_hash) = 32),
    status           text        NOT NULL CHECK (status IN ('in_progress', 'completed')),
    -- The stored response, set when the row is completed.
    response_code    int,
    -- The allow-listed response headers, in order: a JSON array of [name, value] pairs.
    response_headers jsonb,
    response_body    bytea,
    -- True when the body was larger than the storage cap and was not kept.
    body_omitted     boolean     NOT NULL DEFAULT false,
    created_at       timestamptz NOT NULL,
    -- created_at + retention: after this the key may be used afresh.
    expires_at       timestamptz NOT NULL,
    -- An in-progress claim holds the key until then (its worker renews it while it runs).
    lease_until      timestamptz NOT NULL,
    -- Identifies the current claim; only its holder may complete, renew or release the row.
    fencing_token    bigint      NOT NULL,
    PRIMARY KEY (account_id, idem_key),
    CONSTRAINT idempotency_keys_completed_has_response CHECK (
        status <> 'completed'
        OR (response_code IS NOT NULL AND response_headers IS NOT NULL AND response_body IS NOT NULL)
    )
);

COMMENT ON TABLE idempotency_keys IS
    'idem: one row per (account, Idempotency-Key); the response replayed to retries of the same request';

-- The sweeper deletes by expiry.
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);
