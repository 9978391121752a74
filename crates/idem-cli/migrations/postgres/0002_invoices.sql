-- Gapless invoice numbers per account. The counter row is updated in the same transaction as
-- the idempotency key and the invoice, so a rolled-back request gives its number back.
CREATE TABLE invoice_counters (
    account_id  text   PRIMARY KEY,
    last_number bigint NOT NULL
);

CREATE TABLE invoices (
    id         text        PRIMARY KEY,     -- inv_<uuid v7>
    account_id text        NOT NULL,
    number     bigint      NOT NULL,        -- 1, 2, 3, ... per account, no gaps
    amount     bigint      NOT NULL CHECK (amount > 0),
    currency   text        NOT NULL,
    idem_key   text,
    created_at timestamptz NOT NULL,
    UNIQUE (account_id, number)
);
