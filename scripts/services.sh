#!/usr/bin/env bash
# Starts every service the tests talk to that is not already up, on loopback, and checks each:
# PostgreSQL :5432, Redis :6379, NATS with JetStream :4222, RabbitMQ :5672 and tansu (a
# Kafka-compatible broker) :19092. `cargo nextest run --workspace` runs it before any test (a
# setup script in .config/nextest.toml), so the one test command needs nothing before it.
# tansu is built once into ~/.cache/idem-tools (about 9 minutes on a fresh machine).
set -euo pipefail

# A command that fails says which service it was starting and how to start it by hand.
starting=""
trap '[ -n "$starting" ] && echo "error: could not start $starting; by hand: $BASH_COMMAND" >&2' ERR

step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }

# Debian binaries that tests start themselves, installed once when missing: PgBouncer (tests
# start their own in front of PostgreSQL), libfaketime (a proxy whose clock is minutes off),
# protoc (the gRPC tests' code generation), curl (HTTP/2 over ALPN), Chromium with Node.js
# (the console's browser test, tests/admin_console.rs) and valgrind (idem-bench's instruction
# counts).
step "test tools"
missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1 ] || command -v faketime >/dev/null 2>&1 \
  || missing+=(faketime)
command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
command -v curl >/dev/null 2>&1 || missing+=(curl)
# valgrind: idem-bench counts instructions per request under callgrind.
command -v valgrind >/dev/null 2>&1 || missing+=(valgrind)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]} from Debian"
  starting="${missing[*]} (apt-get install -y ${missing[*]})"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  starting=""
fi
# playwright-core for the console's browser test, from its lockfile: again whenever the
# lockfile changes (a stamp of its hash beside the modules), never otherwise.
console="$(cd "$(dirname "$0")/.." && pwd)/crates/idem-cli/tests/console"
stamp="$console/node_modules/.idem-lockfile-sha256"
lock_hash="$(sha256sum "$console/package-lock.json" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$lock_hash" ]; then
  echo "installing the console test's npm packages (npm ci)"
  starting="the console test's npm packages (npm ci --prefix $console)"
  npm ci --silent --no-audit --no-fund --prefix "$console"
  echo "$lock_hash" >"$stamp"
  starting=""
fi
echo "tools ok"

step "services"
wait_for() { # wait_for NAME SECONDS COMMAND...: polls a readiness probe of a service we started
  local name=$1 secs=$2; shift 2
  for _ in $(seq 1 "$((secs * 5))"); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  echo "error: $name did not come up within ${secs}s" >&2
  return 1
}

if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  echo "PostgreSQL is down; starting it"
  starting=PostgreSQL
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
  wait_for PostgreSQL 60 pg_isready -q -h 127.0.0.1 -p 5432
fi
psql -h 127.0.0.1 -U postgres -Atc 'SELECT 1' postgres >/dev/null \
  || { echo "error: PostgreSQL at 127.0.0.1:5432 refuses user postgres" >&2; exit 1; }
echo "PostgreSQL ok"

if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "Redis is down; starting it"
  starting=Redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  wait_for Redis 30 redis-cli -h 127.0.0.1 -p 6379 ping
fi
echo "Redis ok"

tcp_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

if ! tcp_open 4222; then
  echo "NATS is down; starting it with JetStream"
  starting=NATS
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
    -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
  wait_for NATS 30 tcp_open 4222
fi
echo "NATS ok"

if ! tcp_open 5672; then
  echo "RabbitMQ is down; starting it"
  starting=RabbitMQ
  rabbitmq-server -detached
  wait_for RabbitMQ 120 tcp_open 5672
fi
echo "RabbitMQ ok"

# Kafka: tansu, a Kafka-compatible broker from crates.io, built once into a cache outside the
# clone (about 9 minutes on a fresh machine; without --locked it does not build).
TOOLS="$HOME/.cache/idem-tools"
TANSU="$TOOLS/bin/tansu"
if ! tcp_open 19092; then
  starting=tansu
  if [ ! -x "$TANSU" ]; then
    echo "building tansu 0.6.0 into $TOOLS (once per machine)"
    CARGO_TARGET_DIR="$TOOLS/target" cargo install --locked tansu@0.6.0 \
      --features dynostore,postgres --root "$TOOLS"
  fi
  echo "tansu is down; starting it on 127.0.0.1:19092"
  nohup "$TANSU" broker --listener-url tcp://127.0.0.1:19092 \
    --advertised-listener-url tcp://127.0.0.1:19092 --storage-engine memory://tansu/ \
    >"$TOOLS/tansu.log" 2>&1 &
  wait_for tansu 60 tcp_open 19092
fi
echo "tansu (Kafka) ok"

