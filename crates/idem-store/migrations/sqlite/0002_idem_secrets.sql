-- Secrets that every process on this database must share, such as the key from which
-- `idem proxy` derives the accounts of its records from its callers' credentials: made once,
-- by whichever process needs it first (INSERT ... ON CONFLICT DO NOTHING), then read by the
-- others. Whoever can read this file can read the stored responses anyway.
CREATE TABLE idem_secrets (
    name  TEXT NOT NULL PRIMARY KEY,            -- what the secret is for ('idem-proxy-scope')
    value TEXT NOT NULL                         -- the secret, as text (hex)
);
