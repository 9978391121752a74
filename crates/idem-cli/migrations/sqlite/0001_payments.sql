-- The reference service's business table.
CREATE TABLE payments (
    id               TEXT    PRIMARY KEY,       -- pay_<uuid v7>
    account_id       TEXT    NOT NULL,
    -- The key that created the payment, while that key is retained. When the key expires and
    -- is used again, the old payment's key moves to retired_idem_key, so the UNIQUE below is a
    -- safety net exactly for the retention window: one payment per live key.
    idem_key         TEXT,
    retired_idem_key TEXT,
    amount           INTEGER NOT NULL CHECK (amount > 0),  -- minor units
    currency         TEXT    NOT NULL,
    status           TEXT    NOT NULL,
    created_at       INTEGER NOT NULL,          -- Unix milliseconds
    UNIQUE (account_id, idem_key)
);

CREATE INDEX payments_by_account ON payments (account_id, created_at);
