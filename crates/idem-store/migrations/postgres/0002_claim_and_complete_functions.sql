-- The claim and the stored response as functions, so that transaction mode can send BEGIN with
-- the claim in one round trip and the stored response with COMMIT in another (see PgStore).
-- Those go as one simple query of several statements, which returns nothing to the client
-- library, so the transaction-mode functions raise instead of answering false:
--   IK001  the claim lost: another record holds the key (the transaction is then aborted)
--   IK002  the key row vanished inside its own transaction (never expected)
-- Times are Unix milliseconds, converted exactly (see 0001 and PgStore's docs).

-- Claims a key if no record holds it, or replaces a record the claim may replace (past its
-- retention and not held by a live lease; or, if allowed, a stale claim of the same request).
-- One statement, so two claims can never both win. True if the key is now the caller's.
CREATE FUNCTION idem_claim(
    p_account text, p_key text, p_hash bytea, p_now bigint, p_expires bigint, p_lease bigint,
    p_token bigint, p_take_over boolean
) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO idempotency_keys AS k
        (account_id, idem_key, request_hash, status, created_at, expires_at, lease_until,
         fencing_token)
    VALUES (p_account, p_key, p_hash, 'in_progress',
            to_timestamp(p_now / 1000) + (p_now % 1000) * interval '1 millisecond',
            to_timestamp(p_expires / 1000) + (p_expires % 1000) * interval '1 millisecond',
            to_timestamp(p_lease / 1000) + (p_lease % 1000) * interval '1 millisecond',
            p_token)
    ON CONFLICT (account_id, idem_key) DO UPDATE SET
        request_hash = excluded.request_hash,
        status = 'in_progress',
        response_code = NULL,
        response_headers = NULL,
        response_body = NULL,
        body_omitted = false,
        created_at = excluded.created_at,
        expires_at = excluded.expires_at,
        lease_until = excluded.lease_until,
        fencing_token = excluded.fencing_token
    WHERE (k.expires_at <= excluded.created_at
           AND NOT (k.status = 'in_progress' AND k.lease_until > excluded.created_at))
       OR (p_take_over AND k.status = 'in_progress'
           AND k.lease_until <= excluded.created_at
           AND k.request_hash = excluded.request_hash);
    RETURN FOUND;
END $$;

-- The claim inside a transaction (transaction mode): waits on a concurrent claim's row for at
-- most p_lock_wait (a lock_timeout setting; running out raises 55P03), then puts the previous
-- setting back, so that the handler's own writes do not inherit the claim's nearly spent wait.
-- Raises IK001 when the claim loses.
CREATE FUNCTION idem_claim_in_transaction(
    p_account text, p_key text, p_hash bytea, p_now bigint, p_expires bigint, p_lease bigint,
    p_token bigint, p_take_over boolean, p_lock_wait text
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    previous text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', p_lock_wait, true);
    IF NOT idem_claim(p_account, p_key, p_hash, p_now, p_expires, p_lease, p_token,
                      p_take_over) THEN
        RAISE EXCEPTION 'idem: another record holds the idempotency key' USING ERRCODE = 'IK001';
    END IF;
    PERFORM set_config('lock_timeout', previous, true);
END $$;

-- Stores the response of the claim holding p_token. True if it still held the key.
CREATE FUNCTION idem_complete(
    p_account text, p_key text, p_token bigint, p_code int, p_headers jsonb, p_body bytea,
    p_omitted boolean
) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    UPDATE idempotency_keys
    SET status = 'completed', response_code = p_code, response_headers = p_headers,
        response_body = p_body, body_omitted = p_omitted
    WHERE account_id = p_account AND idem_key = p_key AND fencing_token = p_token
      AND status = 'in_progress';
    RETURN FOUND;
END $$;

-- idem_complete inside the claim's own transaction, where the row cannot have gone: raises
-- IK002 (aborting the transaction, so nothing commits unanswered) if it did all the same.
CREATE FUNCTION idem_complete_in_transaction(
    p_account text, p_key text, p_token bigint, p_code int, p_headers jsonb, p_body bytea,
    p_omitted boolean
) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF NOT idem_complete(p_account, p_key, p_token, p_code, p_headers, p_body, p_omitted) THEN
        RAISE EXCEPTION 'idem: the key row vanished inside its own transaction'
            USING ERRCODE = 'IK002';
    END IF;
END $$;
