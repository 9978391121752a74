// stripe-node against idem proxy: run by scripts/stripe_sdks.sh as
//   node check.mjs PROXY_URL UPSTREAM_URL stripe|problem
// With `--errors stripe`, idem's 409 (key in use, after the SDK's own retries) and 422 (key
// reused with another body) must raise: stripe-node 23 makes a StripeIdempotencyError only of
// a 400 or 404, so these are StripeAPIErrors whose `raw.type` is "idempotency_error" and whose
// message is idem's detail. With problem details alone,
// stripe-node resolves them as if they were the charge: checked too, as the reason the
// dialect exists.
import { createRequire } from "node:module";
import assert from "node:assert/strict";

const require = createRequire(process.env.STRIPE_NODE_MODULES + "/");
const Stripe = require("stripe");

const [proxyUrl, upstreamUrl, dialect] = process.argv.slice(2);
const proxy = new URL(proxyUrl);
const stripe = new Stripe("sk_test_idem_sdk_check", {
  host: proxy.hostname,
  port: Number(proxy.port),
  protocol: proxy.protocol.replace(":", ""),
  maxNetworkRetries: 2,
});
// Each attempt the SDK makes, retries included (its "response" event fires once, at the end).
let attempts = 0;
stripe.on("request", () => attempts++);

// The SDK raised a Stripe error made from idem's `error` member.
const raisedByIdem = (error, status) => {
  assert.ok(error instanceof Stripe.errors.StripeError, `${status} gave ${JSON.stringify(error)}`);
  assert.equal(error.statusCode, status);
  assert.equal(error.raw.type, "idempotency_error");
  assert.ok(error.message.length > 0);
};
const upstream = async (path, method = "GET") =>
  (await fetch(upstreamUrl + path, { method })).json();
const key = `sdk-node-${dialect}-${Date.now()}-${process.pid}`;
const params = { amount: 4200, currency: "usd", description: "hold" };

// The original is held at the upstream; the duplicate finds the key in use.
const original = stripe.charges.create(params, { idempotencyKey: key });
while (!(await upstream(`/__calls?key=${key}`)).held) await new Promise((r) => setTimeout(r, 20));
attempts = 0;
let inUse;
try {
  inUse = await stripe.charges.create(params, { idempotencyKey: key });
} catch (error) {
  inUse = error;
}
const inUseAttempts = attempts;
await upstream(`/__release?key=${key}`, "POST");
const charge = await original;
assert.equal(charge.object, "charge");

if (dialect === "stripe") {
  raisedByIdem(inUse, 409);
} else {
  assert.ok(!(inUse instanceof Error), `409 without the dialect raised ${inUse}`);
  assert.equal(inUse.type, "urn:idem:problem:in-use");
}
// A first try and maxNetworkRetries retries, all refused with 409 while the original ran.
assert.equal(inUseAttempts, 3);

const replay = await stripe.charges.create(params, { idempotencyKey: key });
assert.equal(replay.id, charge.id);
assert.equal(replay.lastResponse.headers["idempotent-replayed"], "true");
assert.equal(replay.lastResponse.requestId, charge.lastResponse.requestId);

let mismatch;
try {
  mismatch = await stripe.charges.create({ ...params, amount: 4300 }, { idempotencyKey: key });
} catch (error) {
  mismatch = error;
}
if (dialect === "stripe") {
  raisedByIdem(mismatch, 422);
} else {
  assert.ok(!(mismatch instanceof Error), `422 without the dialect raised ${mismatch}`);
  assert.equal(mismatch.type, "urn:idem:problem:mismatch");
}

const calls = (await upstream(`/__calls?key=${key}`)).calls;
assert.equal(calls, 1, "the upstream saw one charge for the key");
console.log(
  `stripe-node ${Stripe.PACKAGE_VERSION ?? ""} (${dialect}): 409 after ${inUseAttempts} tries -> ` +
    `${inUse instanceof Error ? inUse.constructor.name : "resolved as a charge"}; 422 -> ` +
    `${mismatch instanceof Error ? mismatch.constructor.name : "resolved as a charge"}; ` +
    `replay ${replay.id} with request id ${replay.lastResponse.requestId}; upstream calls ${calls}`,
);
