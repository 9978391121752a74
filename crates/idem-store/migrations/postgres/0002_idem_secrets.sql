-- Secrets that every process on this database must share, such as the key from which
-- `idem proxy` derives the accounts of its records from its callers' credentials: made once,
-- by whichever process needs it first (INSERT ... ON CONFLICT DO NOTHING), then read by the
-- others, so that gateways on one database agree on every caller's scope.
--
-- Whoever can read this table can test a guessed credential against the records' accounts;
-- whoever can read idempotency_keys can read the stored responses anyway. A gateway given its
-- secret explicitly (--secret) neither reads nor writes its row.
CREATE TABLE idem_secrets (
    -- What the secret is for ('idem-proxy-scope').
    name  text PRIMARY KEY,
    -- The secret, as text (hex).
    value text NOT NULL
);
