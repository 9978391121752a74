SELECT id, amount, currency, status, reference, created_at FROM payments
