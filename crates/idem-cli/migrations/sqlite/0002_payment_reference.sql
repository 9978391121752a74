-- The caller's own reference for a payment (an order number, say), shown back to it. The
-- simulator uses it to attribute charges to intents when it sends no idempotency key.
ALTER TABLE payments ADD COLUMN reference TEXT;
