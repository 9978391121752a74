INSERT INTO payments
    (id, account_id, idem_key, amount, currency, status, reference, created_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
