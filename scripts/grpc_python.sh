#!/usr/bin/env bash
# Installs Python's grpcio and grpcio-tools (PyPI) into a venv under ~/.cache/idem-tools, for
# the gRPC tests (crates/idem-grpc-tests), which run scripts/grpc_python.py with it. Does
# nothing when the venv already has these versions.
#
#   scripts/grpc_python.sh            (prints the venv's python)
set -euo pipefail

GRPCIO_VERSION=1.85.1
venv="$HOME/.cache/idem-tools/grpc-venv"

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
