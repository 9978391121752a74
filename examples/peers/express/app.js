'use strict';
// The gallery's Express app: express-idempotency with its Redis adapter, set up as their
// READMEs say (the middleware on POST routes, `app.post(path, idempotency({ dataAdapter }))`,
// with Express 5's path for the one route; the handler returning early on `isHit`; failures
// reported with `reportError`), default options otherwise, in front of the in-memory payments
// handler of examples/peers/payments.py (the same rules, in JavaScript).
//
//   REDIS_URL=redis://127.0.0.1:6379/13 PORT=0 node examples/peers/express/app.js
//
// The packages come from the npm prefix in NODE_PATH (scripts/gallery.sh installs them).
const crypto = require('node:crypto');
const express = require('express');
const idempotency = require('express-idempotency');
const RedisAdapter = require('express-idempotency-redis-adapter').default;

const TOKENS = { sk_test_alice: 'acct_alice', sk_test_bob: 'acct_bob' };
const PROVIDER_DELAY = Number(process.env.PROVIDER_DELAY_MS || 100);
const payments = new Map();

const adapter = new RedisAdapter({ connectionConfig: { url: process.env.REDIS_URL } });

const app = express();
app.get('/healthz', (req, res) => res.json({ status: 'ok' }));
app.use(express.json());
// Authentication first, as an Express app usually has it.
app.use((req, res, next) => {
  const header = req.get('authorization') || '';
  const account = header.startsWith('Bearer ') ? TOKENS[header.slice(7).trim()] : undefined;
  if (!account) {
    res.status(401).json({ error: 'unknown token' });
    return;
  }
  req.account = account;
  next();
});
app.post('/payments', idempotency.idempotency({ dataAdapter: adapter }), async (req, res) => {
  const service = idempotency.getSharedIdempotencyService();
  if (service.isHit(req)) {
    return;
  }
  const { amount, currency } = req.body || {};
  if (!Number.isInteger(amount) || amount <= 0 || !/^[A-Z]{3}$/.test(currency || '')) {
    res.status(400).json({ error: 'invalid payment' });
    return;
  }
  await new Promise((resolve) => setTimeout(resolve, PROVIDER_DELAY));
  if (currency === 'XTS') {
    await service.reportError(req);
    res.status(500).json({ error: 'provider failed' });
    return;
  }
  const id = `pay_${crypto.randomUUID().replaceAll('-', '')}`;
  const payment = { id, amount, currency, status: 'succeeded' };
  payments.set(id, { account: req.account, payment });
  res.status(201).location(`/payments/${id}`).json(payment);
});

app.get('/payments/:id', (req, res) => {
  const found = payments.get(req.params.id);
  if (!found || found.account !== req.account) {
    res.status(404).json({ error: 'no such payment' });
    return;
  }
  res.json(found.payment);
});

adapter.connect().then(() => {
  const server = app.listen(Number(process.env.PORT || 0), '127.0.0.1', () => {
    console.log(`listening on http://127.0.0.1:${server.address().port}`);
  });
}).catch((error) => {
  console.error(error);
  process.exit(1);
});
