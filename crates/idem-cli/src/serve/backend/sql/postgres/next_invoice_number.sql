INSERT INTO invoice_counters AS c (account_id, last_number) VALUES ($1, 1)
ON CONFLICT (account_id) DO UPDATE SET last_number = c.last_number + 1
RETURNING last_number
