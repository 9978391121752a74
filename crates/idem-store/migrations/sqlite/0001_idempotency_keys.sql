-- One row per (account, key): the request's fingerprint and, once finished, its response.
-- Times are Unix milliseconds from the service's clock, so tests can move time.
CREATE TABLE idempotency_keys (
    account_id       TEXT    NOT NULL,
    idem_key         TEXT    NOT NULL,
    request_hash     BLOB    NOT NULL,          -- SHA-256 fingerprint, 32 bytes
    status           TEXT    NOT NULL CHECK (status IN ('in_progress', 'completed')),
    response_code    INTEGER,                   -- set when completed
    response_headers TEXT,                      -- JSON array of [name, value] pairs
    response_body    BLOB,
    body_omitted     INTEGER NOT NULL DEFAULT 0, -- 1: the body was over the storage cap
    created_at       INTEGER NOT NULL,
    expires_at       INTEGER NOT NULL,          -- created_at + retention
    lease_until      INTEGER NOT NULL,          -- an in-progress claim holds until then
    fencing_token    INTEGER NOT NULL,          -- identifies the current claim
    PRIMARY KEY (account_id, idem_key)
) WITHOUT ROWID;

-- The sweeper deletes by expiry.
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);
