#!/usr/bin/env bash
# The drill's gallery: `idem drill` and `idem simulate --url` against real idempotency packages
# from npm and PyPI, each in a small app under examples/peers/ (the package set up as its
# documentation says, in front of one in-memory payments handler), beside idem's own layer
# (`idem serve`) and gateway (`idem proxy` in front of examples/peers/plain.py), and a baseline
# with no idempotency at all. Writes each run's JSON and a markdown table generated from them
# (scripts/gallery_table.py), and prints the table.
#
#   scripts/gallery.sh
#
# Fails when a drill could not run (exit 2), when idem's layer or gateway departs from any rule
# of `--profile idem` (a FAIL or a WARN), or when idem's simulator runs find a double charge
# with keys. What the third-party packages do is measured and reported, never a failure here.
#
# Packages are installed once, by version, under ~/.cache/idem-tools (a Python venv and an npm
# prefix). Redis (127.0.0.1:6379) holds the Express and Powertools records, in database 13,
# emptied before and after.
#
# Environment: CARGO_TARGET_DIR; IDEM_GALLERY_OUT (default ~/.cache/idem-tools/gallery: the
# JSON of each run and gallery.md); IDEM_GALLERY_ROUNDS (the drill's --rounds, default its own);
# IDEM_GALLERY_REQUESTS (simulated intents, default 200); IDEM_GALLERY_REDIS (default
# redis://127.0.0.1:6379/13).
set -euo pipefail
cd "$(dirname "$0")/.."

EXPRESS_VERSION=5.3.0
EXPRESS_IDEMPOTENCY_VERSION=1.0.6
EXPRESS_REDIS_ADAPTER_VERSION=1.0.8
DJANGO_VERSION=4.2.30
DJANGO_IDEMPOTENCY_KEY_VERSION=1.3.0
FASTAPI_VERSION=0.165.0
UVICORN_VERSION=0.55.0
FASTAPI_IDEMPOTENCY_KEY_VERSION=0.1.1
POWERTOOLS_VERSION=3.37.0

tools="$HOME/.cache/idem-tools"
pip_packages=(
  "django==$DJANGO_VERSION"
  "django-idempotency-key==$DJANGO_IDEMPOTENCY_KEY_VERSION"
  "fastapi==$FASTAPI_VERSION"
  "uvicorn==$UVICORN_VERSION"
  "fastapi-idempotency-key==$FASTAPI_IDEMPOTENCY_KEY_VERSION"
  "aws-lambda-powertools[redis,aws-sdk]==$POWERTOOLS_VERSION"
)
npm_packages=(
  "express@$EXPRESS_VERSION"
  "express-idempotency@$EXPRESS_IDEMPOTENCY_VERSION"
  "express-idempotency-redis-adapter@$EXPRESS_REDIS_ADAPTER_VERSION"
)
# One folder per set of versions: a changed pin installs afresh beside the old one.
stamp="$(printf '%s\n' "${pip_packages[@]}" "${npm_packages[@]}" | sha256sum | cut -c1-12)"
venv="$tools/gallery-venv-$stamp"
npm_dir="$tools/gallery-npm-$stamp"
out="${IDEM_GALLERY_OUT:-$tools/gallery}"
requests="${IDEM_GALLERY_REQUESTS:-200}"
redis_url="${IDEM_GALLERY_REDIS:-redis://127.0.0.1:6379/13}"
rounds_args=()
[ -z "${IDEM_GALLERY_ROUNDS:-}" ] || rounds_args=(--rounds "$IDEM_GALLERY_ROUNDS")
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}"

if ! command -v node >/dev/null 2>&1; then
  echo "== installing Node.js (Debian)"
  apt-get update -qq && apt-get install -y -qq nodejs npm
fi
if [ ! -f "$npm_dir/node_modules/express-idempotency-redis-adapter/package.json" ]; then
  echo "== installing ${npm_packages[*]} into $npm_dir"
  mkdir -p "$npm_dir"
  npm install --silent --no-audit --no-fund --prefix "$npm_dir" "${npm_packages[@]}"
fi
if [ ! -f "$venv/.installed" ]; then
  echo "== installing ${pip_packages[*]} into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "${pip_packages[@]}"
  touch "$venv/.installed"
fi
redis-cli -u "$redis_url" ping >/dev/null

echo "== building idem"
cargo build --quiet -p idem-cli --bin idem
idem="$CARGO_TARGET_DIR/debug/idem"

mkdir -p "$out"
rm -f "$out"/*.json "$out/gallery.md"
scratch="$(mktemp -d "${TMPDIR:-/tmp}/idem-gallery.XXXXXX")"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  redis-cli -u "$redis_url" flushdb >/dev/null 2>&1 || true
  rm -rf "$scratch"
}
trap cleanup EXIT
redis-cli -u "$redis_url" flushdb >/dev/null

# start NAME PATTERN COMMAND...: starts COMMAND, its output in $scratch/NAME.log, and sets
# $base to the address its line matching PATTERN (a sed group) names once it listens.
start() {
  local name=$1 pattern=$2
  shift 2
  local log="$scratch/$name.log"
  : >"$log"
  "$@" >"$log" 2>&1 &
  local pid=$!
  pids+=("$pid")
  base=""
  for _ in $(seq 1 300); do
    base="$(sed -n "s|$pattern|\1|p" "$log" | head -n1)"
    [ -z "$base" ] || return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "error: $name did not start:" >&2
  cat "$log" >&2
  return 1
}
app_line='^listening on \(http://[^ ]*\).*'

# measure NAME [PROFILE]: the drill (and, under the draft profile, the simulator) against
# $base/payments. A drill that could not run stops the gallery.
measure() {
  local name=$1 profile=${2:-draft} code=0
  echo "== $name: idem drill --profile $profile"
  "$idem" drill --url "$base/payments" --token-a sk_test_alice --token-b sk_test_bob \
    --profile "$profile" "${rounds_args[@]}" --failing-body '{"amount": 500, "currency": "XTS"}' \
    --json >"$out/$name.$profile.drill.json" || code=$?
  if [ "$code" -gt 1 ]; then
    echo "error: the drill could not run against $name (exit $code)" >&2
    return 1
  fi
  [ "$profile" = draft ] || return 0
  echo "== $name: idem simulate --url"
  code=0
  "$idem" simulate --url "$base/payments" --header "Authorization: Bearer sk_test_alice" \
    --requests "$requests" --loss 0.05 --json >"$out/$name.simulate.json" || code=$?
  if [ "$code" -gt 1 ]; then
    echo "error: the simulator could not run against $name (exit $code)" >&2
    return 1
  fi
}

# stop_last: stops the app started last (and, for the gateway, its upstream before it).
stop_last() {
  local pid=${pids[-1]}
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  unset 'pids[-1]'
}

peers="examples/peers"
export PYTHONPATH="$PWD/$peers" PYTHONDONTWRITEBYTECODE=1 REDIS_URL="$redis_url"

start plain "$app_line" python3 "$peers/plain.py" --port 0
measure plain
upstream=$base

start express "$app_line" env NODE_PATH="$npm_dir/node_modules" NODE_ENV=production PORT=0 \
  node "$peers/express/app.js"
measure express
stop_last

start django "$app_line" "$venv/bin/python" "$peers/django_app.py" --port 0
measure django
stop_last

start fastapi "$app_line" "$venv/bin/python" "$peers/fastapi_app.py" --port 0
measure fastapi
stop_last

start powertools "$app_line" "$venv/bin/python" "$peers/powertools_app.py" --port 0
measure powertools
stop_last

start powertools-validation "$app_line" env POWERTOOLS_PAYLOAD_VALIDATION=1 \
  "$venv/bin/python" "$peers/powertools_app.py" --port 0
measure powertools-validation
stop_last

# idem's own: a short retention, so the expiry check runs instead of skipping.
start idem-serve '^idem serve: listening on \(http://[^ ]*\) .*' \
  "$idem" serve --listen 127.0.0.1:0 --database "sqlite://$scratch/serve.db" --retention-secs 3
measure idem-serve
measure idem-serve idem
stop_last

start idem-proxy '^idem proxy: listening on \(http://[^ ]*\) .*' \
  "$idem" proxy --listen 127.0.0.1:0 --upstream "$upstream" --store "sqlite://$scratch/proxy.db" \
  --secret "a-throwaway-secret-for-the-gallery" --retention-secs 3
measure idem-proxy
measure idem-proxy idem
stop_last

python3 scripts/gallery_table.py "$out" \
  --version "express-idempotency $EXPRESS_IDEMPOTENCY_VERSION + express-idempotency-redis-adapter $EXPRESS_REDIS_ADAPTER_VERSION (Express $EXPRESS_VERSION)" \
  --version "django-idempotency-key $DJANGO_IDEMPOTENCY_KEY_VERSION (Django $DJANGO_VERSION)" \
  --version "fastapi-idempotency-key $FASTAPI_IDEMPOTENCY_KEY_VERSION (FastAPI $FASTAPI_VERSION, uvicorn $UVICORN_VERSION)" \
  --version "aws-lambda-powertools $POWERTOOLS_VERSION (extras redis and aws-sdk: boto3, which the Lambda runtime ships)" \
  >"$out/gallery.md"
cat "$out/gallery.md"
python3 scripts/gallery_table.py "$out" --check
