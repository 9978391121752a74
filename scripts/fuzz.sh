#!/usr/bin/env bash
# Fuzzes each cargo-fuzz target in fuzz/ for SECONDS_PER_TARGET (default 60) and prints the
# executions per target. Exits non-zero if any target crashed; the crashing input is left in
# fuzz/artifacts/<target>/ (reproduce with `cargo fuzz run <target> <file>`).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET [TARGET...]]     (default: 60 s, every target)
#
# Works from a clean clone: installs cargo-fuzz if missing and builds on the pinned stable
# toolchain (RUSTC_BOOTSTRAP=1 unlocks the -Z flags cargo-fuzz passes).
set -euo pipefail
cd "$(dirname "$0")/.."

secs="${1:-60}"
targets=(key_parser canonical_json fingerprint layer_request server_head)
if [ $# -gt 1 ]; then
  shift
  targets=("$@")
fi

export RUSTC_BOOTSTRAP=1
target_dir="${IDEM_FUZZ_TARGET_DIR:-$HOME/.cache/idem-fuzz-target}"

if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi

# No sanitizer: the project forbids unsafe code, so ASan would mostly slow the search; debug
# assertions (-a) catch what safe Rust can get wrong, such as overflow.
build_flags=(-O -a -s none --target-dir "$target_dir")

echo "== building ${targets[*]}"
cargo fuzz build "${build_flags[@]}"

# libFuzzer writes what it finds to the first corpus directory: a scratch one, so the
# committed seeds in fuzz/corpus/ stay small. The layer target's SQLite database goes there
# too (on tmpfs when there is one, so commits do not wait on fsync).
scratch_root=/dev/shm
[[ -d $scratch_root && -w $scratch_root ]] || scratch_root="${TMPDIR:-/tmp}"
scratch="$(mktemp -d "$scratch_root/idem-fuzz.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT

declare -A dict=([canonical_json]=json [fingerprint]=json [layer_request]=http [server_head]=http)
summary=()
failed=0
for t in "${targets[@]}"; do
  echo "== fuzzing $t for ${secs}s"
  mkdir -p "$scratch/$t/corpus" "$scratch/$t/tmp" "fuzz/artifacts/$t"
  args=(-max_total_time="$secs" -timeout=10 -print_final_stats=1)
  [[ -n ${dict[$t]:-} ]] && args+=(-dict="fuzz/dict/${dict[$t]}.dict")
  log="$scratch/$t/log"
  start=$SECONDS
  status=ok
  TMPDIR="$scratch/$t/tmp" cargo fuzz run "${build_flags[@]}" "$t" \
    "$scratch/$t/corpus" "fuzz/corpus/$t" -- "${args[@]}" >"$log" 2>&1 || status=CRASH
  wall=$((SECONDS - start))
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
  # A crash skips the final stats; take the last status line's count instead.
  [[ -n $execs ]] || execs="$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')"
  corpus="$(find "$scratch/$t/corpus" -type f | wc -l)"
  if [[ $status != ok ]]; then
    failed=1
    tail -n 40 "$log"
  fi
  summary+=("$(printf '%-16s %12s %8s %8s  %s' "$t" "${execs:-?}" "${wall}s" "$corpus" "$status")")
done

echo
printf '%-16s %12s %8s %8s  %s\n' target executions wall new-inputs result
printf '%s\n' "${summary[@]}"
exit "$failed"
