INSERT INTO invoices (id, account_id, number, amount, currency, idem_key, created_at)
VALUES ($1, $2, $3, $4, $5, $6,
        to_timestamp($7 / 1000) + ($7 % 1000) * interval '1 millisecond')
