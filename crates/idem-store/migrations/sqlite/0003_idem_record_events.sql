-- Each key's history: what operators and reconcilers did to it (resolved, reconciled), and by
-- whom. Written only by those rare operations, never by a request's claim, renewal or
-- completion. Bounded: writing an event deletes every key's events older than 30 days (by the
-- new event's time) and keeps the key's latest 100; purging a key deletes its events too.
CREATE TABLE IF NOT EXISTS idem_record_events (
    id          INTEGER PRIMARY KEY,           -- the order the events were written in
    account_id  TEXT    NOT NULL,
    idem_key    TEXT    NOT NULL,
    at          INTEGER NOT NULL,              -- Unix milliseconds, the writer's clock
    what        TEXT    NOT NULL,              -- 'resolved: released', ...
    by_whom     TEXT    NOT NULL               -- 'idem keys (CLI)', 'reconciler', ...
);

CREATE INDEX IF NOT EXISTS idem_record_events_key ON idem_record_events (account_id, idem_key, id);
CREATE INDEX IF NOT EXISTS idem_record_events_at ON idem_record_events (at);
