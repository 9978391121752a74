#!/usr/bin/env bash
# Stripe's own SDKs against `idem proxy` in front of a Stripe-shaped upstream
# (scripts/stripe-sdks/upstream.py): stripe-node and stripe-python, each with `--errors stripe`
# (idem's 409 after the SDK's retries and its 422 raise the SDK's idempotency error) and with
# problem details alone (they do not: the reason the dialect exists). Both also check that a
# retry is a replay with the upstream's Request-Id (`--store-header Request-Id`) and that the
# upstream saw one charge per key. The SDKs are installed once into ~/.cache/idem-tools.
#
#   scripts/stripe_sdks.sh
#
# Environment: CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

STRIPE_NODE_VERSION=23.1.0
STRIPE_PYTHON_VERSION=16.1.0
tools="$HOME/.cache/idem-tools"
node_dir="$tools/stripe-node-$STRIPE_NODE_VERSION"
venv="$tools/stripe-python-$STRIPE_PYTHON_VERSION"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}"

if ! command -v node >/dev/null 2>&1; then
  echo "== installing Node.js (Debian)"
  apt-get update -qq && apt-get install -y -qq nodejs npm
fi
if [ ! -f "$node_dir/node_modules/stripe/package.json" ]; then
  echo "== installing stripe-node $STRIPE_NODE_VERSION into $node_dir"
  mkdir -p "$node_dir"
  npm install --silent --no-audit --no-fund --prefix "$node_dir" "stripe@$STRIPE_NODE_VERSION"
fi
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import stripe" 2>/dev/null; then
  echo "== installing stripe-python $STRIPE_PYTHON_VERSION into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "stripe==$STRIPE_PYTHON_VERSION"
fi

echo "== building idem"
cargo build --quiet -p idem-cli --bin idem
idem="$CARGO_TARGET_DIR/debug/idem"

scratch="$(mktemp -d "${TMPDIR:-/tmp}/idem-stripe-sdks.XXXXXX")"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$scratch"
}
trap cleanup EXIT

# address_from LOG PATTERN PID: waits until the process prints the line that gives its address.
address_from() {
  local log=$1 pattern=$2 pid=$3 address
  for _ in $(seq 1 300); do
    address="$(sed -n "s|$pattern|\1|p" "$log")"
    if [ -n "$address" ]; then echo "$address"; return 0; fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "error: it did not start:" >&2
  cat "$log" >&2
  return 1
}

: >"$scratch/upstream.log"
python3 scripts/stripe-sdks/upstream.py >"$scratch/upstream.log" 2>&1 &
pids+=($!)
upstream="$(address_from "$scratch/upstream.log" '^upstream listening on \(http://[^ ]*\).*' "$!")"

for dialect in stripe problem; do
  : >"$scratch/proxy-$dialect.log"
  "$idem" proxy --listen 127.0.0.1:0 --upstream "$upstream" --store "sqlite://$scratch/$dialect.db" \
    --secret "a-throwaway-secret-for-the-sdk-check" --errors "$dialect" --store-header Request-Id \
    >"$scratch/proxy-$dialect.log" 2>&1 &
  pids+=($!)
  proxy="$(address_from "$scratch/proxy-$dialect.log" '^idem proxy: listening on \(http://[^ ]*\) .*' "$!")"
  STRIPE_NODE_MODULES="$node_dir/node_modules" node scripts/stripe-sdks/check.mjs "$proxy" "$upstream" "$dialect"
  "$venv/bin/python" scripts/stripe-sdks/check.py "$proxy" "$upstream" "$dialect"
done
echo "stripe SDKs: passed"
