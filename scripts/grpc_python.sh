#!/usr/bin/env bash
# Installs Python's grpcio and grpcio-tools (PyPI) into a venv under ~/.cache/idem-tools, for
# the gRPC tests (crates/idem-grpc-tests), which run scripts/grpc_python.py with it. Does
# nothing when the venv already has these versions.
#
#   scripts/grpc_python.sh            (prints the venv's python)
set -euo pipefail

GRPCIO_VERSION=1.85.1
venv="$HOME/.cache/idem-tools/grpc-venv"

# Several tests call this at once on a fresh machine: one installs while the others wait, or
# two pip runs in one venv read each other's half-written packages.
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9

if ! "$venv/bin/python" - "$GRPCIO_VERSION" 2>/dev/null <<'PY'
import sys, grpc, grpc_tools  # noqa: F401
sys.exit(grpc.__version__ != sys.argv[1])
PY
then
  echo "== installing grpcio $GRPCIO_VERSION into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "grpcio==$GRPCIO_VERSION" "grpcio-tools==$GRPCIO_VERSION"
fi
echo "$venv/bin/python"
