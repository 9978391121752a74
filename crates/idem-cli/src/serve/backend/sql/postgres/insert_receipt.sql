INSERT INTO receipts (event_id, payment_id, account_id, amount, currency, created_at)
VALUES ($1, $2, $3, $4, $5, $6)
