UPDATE payments SET retired_idem_key = idem_key, idem_key = NULL
WHERE account_id = ?1 AND idem_key = ?2 AND created_at <= ?3
