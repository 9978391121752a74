INSERT INTO invoice_counters (account_id, last_number) VALUES (?1, 1)
ON CONFLICT (account_id) DO UPDATE SET last_number = last_number + 1
RETURNING last_number
