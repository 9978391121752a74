-- The reference service's business table.
CREATE TABLE payments (
    id               text        PRIMARY KEY,       -- pay_<uuid v7>
    account_id       text        NOT NULL,
    -- The key that created the payment, while that key is retained. When the key expires and
    -- is used again, the old payment's key moves to retired_idem_key, so the UNIQUE below is a
    -- safety net exactly for the retention window: one payment per live key.
    idem_key         text,
    retired_idem_key text,
    amount           bigint      NOT NULL CHECK (amount > 0),  -- minor units
    currency         text        NOT NULL,
    status           text        NOT NULL,
    reference        text,                          -- the caller's own reference
    created_at       timestamptz NOT NULL,
    UNIQUE (account_id, idem_key)
);

CREATE INDEX payments_by_account ON payments (account_id, created_at);
