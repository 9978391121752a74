-- Each key's history: what operators and reconcilers did to it (resolved, reconciled), and by
-- whom, read by every process on this database. Written only by those rare operations, never
-- by a request's claim, renewal or completion, so it costs the request path nothing.
--
-- Bounded: writing an event deletes every key's events older than 30 days (by the new event's
-- time) and keeps the key's latest 100; purging a key deletes its events with its record.
-- Kept apart from idempotency_keys, so a key's history outlives a release of its record.
-- IF NOT EXISTS: a database that has the table already (made by hand) keeps it.
CREATE TABLE IF NOT EXISTS idem_record_events (
    -- The order the events were written in.
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account_id  text   NOT NULL,
    idem_key    text   NOT NULL,
    -- When, by the writer's clock: Unix milliseconds.
    at          bigint NOT NULL,
    -- What happened ('resolved: completed with status 201', 'reconciled: released', ...).
    what        text   NOT NULL,
    -- Who did it ('idem keys (CLI)', 'admin API', 'console', 'reconciler', ...).
    by_whom     text   NOT NULL
);

-- A key's history, in order; and the expiry of old events.
CREATE INDEX IF NOT EXISTS idem_record_events_key ON idem_record_events (account_id, idem_key, id);
CREATE INDEX IF NOT EXISTS idem_record_events_at ON idem_record_events (at);
