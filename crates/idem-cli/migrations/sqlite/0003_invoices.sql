-- Gapless invoice numbers per account. The counter row is updated in the same transaction as
-- the idempotency key and the invoice, so a rolled-back request gives its number back.
CREATE TABLE invoice_counters (
    account_id  TEXT    PRIMARY KEY,
    last_number INTEGER NOT NULL
);

CREATE TABLE invoices (
    id         TEXT    PRIMARY KEY,         -- inv_<uuid v7>
    account_id TEXT    NOT NULL,
    number     INTEGER NOT NULL,            -- 1, 2, 3, ... per account, no gaps
    amount     INTEGER NOT NULL CHECK (amount > 0),
    currency   TEXT    NOT NULL,
    idem_key   TEXT,
    created_at INTEGER NOT NULL,            -- Unix milliseconds
    UNIQUE (account_id, number)
);
