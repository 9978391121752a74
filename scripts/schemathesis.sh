#!/usr/bin/env bash
# Runs schemathesis against a live `idem serve`, from the document it serves at
# GET /openapi.json: first on a temporary SQLite file, then on a throwaway PostgreSQL database.
# Every phase (examples, coverage, fuzzing, stateful: a created payment is fetched through the
# document's links), with the bearer token of acct_alice. Fails when a response is a 5xx or
# does not conform to the document (status, content type, headers, body), or when the database
# afterwards holds two payments for one key.
#
#   scripts/schemathesis.sh [sqlite|postgres]...     (default: both)
#
# Environment: IDEM_SCHEMATHESIS_EXAMPLES (examples per operation and phase, default 500:
# about a minute per database on 2 cores),
# IDEM_SCHEMATHESIS_SEED (default: a new seed each run, printed), IDEM_PG_URL (default
# postgres://postgres@127.0.0.1:5432), CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

SCHEMATHESIS_VERSION=4.32.5
venv="$HOME/.cache/idem-tools/schemathesis-venv"
examples="${IDEM_SCHEMATHESIS_EXAMPLES:-500}"
# schemathesis keeps its example database and replayable failures in its working directory:
# one outside the clone, where `st replay ID` works after a failed run.
work="$HOME/.cache/idem-tools/schemathesis-work"
pg_url="${IDEM_PG_URL:-postgres://postgres@127.0.0.1:5432}"
backends=("$@")
[ ${#backends[@]} -gt 0 ] || backends=(sqlite postgres)
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}"

if [ "$("$venv/bin/st" --version 2>/dev/null)" != "st, version $SCHEMATHESIS_VERSION" ]; then
  echo "== installing schemathesis $SCHEMATHESIS_VERSION into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "schemathesis==$SCHEMATHESIS_VERSION"
fi

echo "== building idem"
cargo build --quiet -p idem-cli --bin idem
idem="$CARGO_TARGET_DIR/debug/idem"

scratch="$(mktemp -d "${TMPDIR:-/tmp}/idem-schemathesis.XXXXXX")"
server_pid=""
pg_db=""
stop_server() {
  if [ -n "$server_pid" ]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=""
  fi
}
cleanup() {
  stop_server
  if [ -n "$pg_db" ]; then
    psql "$pg_url/postgres" -qAtc "DROP DATABASE IF EXISTS $pg_db WITH (FORCE)" || true
  fi
  rm -rf "$scratch"
}
trap cleanup EXIT

# start_server DATABASE_URL: starts idem serve on a free port (the kernel picks it) and sets
# $base_url from the address it prints once it listens.
start_server() {
  local log="$scratch/serve.log"
  : >"$log"
  "$idem" serve --listen 127.0.0.1:0 --database "$1" >"$log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 300); do
    base_url="$(sed -n 's|^idem serve: listening on \(http://[^ ]*\).*|\1|p' "$log")"
    if [ -n "$base_url" ]; then return 0; fi
    if ! kill -0 "$server_pid" 2>/dev/null; then break; fi
    sleep 0.1
  done
  echo "error: idem serve did not start:" >&2
  cat "$log" >&2
  return 1
}

checks=not_a_server_error,status_code_conformance,content_type_conformance
checks+=,response_headers_conformance,response_schema_conformance,unsupported_method

# run_schemathesis NAME: the whole suite against $base_url.
run_schemathesis() {
  local seed=()
  [ -z "${IDEM_SCHEMATHESIS_SEED:-}" ] || seed=(--seed "$IDEM_SCHEMATHESIS_SEED")
  local started=$SECONDS
  mkdir -p "$work"
  (cd "$work" && "$venv/bin/st" run "$base_url/openapi.json" \
    --checks "$checks" \
    --header "Authorization: Bearer sk_test_alice" \
    --max-examples "$examples" "${seed[@]}" \
    --phases examples,coverage,fuzzing,stateful \
    --workers 2 \
    --request-timeout 30 \
    --warnings off) \
    || { echo "error: schemathesis failed on $1 (replay from $work with st replay ID)" >&2; return 1; }
  echo "schemathesis on $1: $((SECONDS - started)) s"
}

# check_one_payment_per_key NAME QUERY_COMMAND...: the command prints the rows of the
# duplicates query; there must be none.
duplicates_sql="SELECT account_id, idem_key, COUNT(*) FROM payments
  WHERE idem_key IS NOT NULL GROUP BY account_id, idem_key HAVING COUNT(*) > 1"
payments_sql="SELECT COUNT(*) || ' payments, ' || COUNT(DISTINCT idem_key) || ' keys' FROM payments"
check_one_payment_per_key() {
  local name=$1; shift
  local duplicates
  duplicates="$("$@" "$duplicates_sql")"
  echo "$name: $("$@" "$payments_sql")"
  if [ -n "$duplicates" ]; then
    echo "error: $name holds several payments for one key:" >&2
    echo "$duplicates" >&2
    return 1
  fi
  echo "$name: no key has two payments"
}

for backend in "${backends[@]}"; do
  case "$backend" in
    sqlite)
      echo "== schemathesis against idem serve on SQLite"
      db="$scratch/idem.db"
      start_server "sqlite://$db"
      run_schemathesis sqlite
      stop_server
      check_one_payment_per_key SQLite sqlite3 "$db"
      ;;
    postgres)
      echo "== schemathesis against idem serve on PostgreSQL"
      pg_db="idem_schemathesis_$$_$RANDOM"
      psql "$pg_url/postgres" -qAtc "CREATE DATABASE $pg_db"
      start_server "$pg_url/$pg_db"
      run_schemathesis postgres
      stop_server
      check_one_payment_per_key PostgreSQL psql "$pg_url/$pg_db" -qAtc
      psql "$pg_url/postgres" -qAtc "DROP DATABASE $pg_db WITH (FORCE)"
      pg_db=""
      ;;
    *)
      echo "error: unknown backend $backend (sqlite or postgres)" >&2
      exit 2
      ;;
  esac
done
