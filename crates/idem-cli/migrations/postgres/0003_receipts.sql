-- The worker's side effect: one receipt per payment.succeeded event. event_id is deliberately
-- not unique: the inbox (processed_events) is what makes a receipt happen once, and a second
-- receipt for an event must stay visible to the tests that prove it never happens.
CREATE TABLE receipts (
    id         BIGSERIAL PRIMARY KEY,
    event_id   TEXT   NOT NULL,
    payment_id TEXT   NOT NULL,
    account_id TEXT   NOT NULL,
    amount     BIGINT NOT NULL,
    currency   TEXT   NOT NULL,
    created_at BIGINT NOT NULL -- ms since the Unix epoch
);
CREATE INDEX receipts_by_event ON receipts (event_id);
