-- The consumer's inbox: one row per (consumer, event) it has applied. The primary key is the
-- whole dedup: a second insert of the same pair inserts nothing.
CREATE TABLE processed_events (
    consumer     TEXT   NOT NULL,
    event_id     TEXT   NOT NULL,
    processed_at BIGINT NOT NULL, -- ms since the Unix epoch
    PRIMARY KEY (consumer, event_id)
);
CREATE INDEX processed_events_by_age ON processed_events (processed_at);

-- The producer's outbox, written in the business transaction. seq orders the relay's work.
CREATE TABLE outbox (
    seq        BIGSERIAL PRIMARY KEY,
    event_id   TEXT   NOT NULL UNIQUE,
    topic      TEXT   NOT NULL,
    payload    BYTEA  NOT NULL,
    created_at BIGINT NOT NULL,
    sent_at    BIGINT
);
CREATE INDEX outbox_pending ON outbox (seq) WHERE sent_at IS NULL;
