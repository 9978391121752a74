SELECT id, amount, currency, status, reference,
       (extract(epoch FROM created_at) * 1000)::bigint AS created_at
FROM payments
