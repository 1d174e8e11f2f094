#!/usr/bin/env bash
# Coverage-guided fuzzing of every parser (fuzz/README.md): builds the cargo-fuzz crate with the
# nightly toolchain (installing cargo-fuzz from crates.io when missing) and runs each target for
# SECONDS (default 60) at low priority, from its committed corpus (fuzz/corpus/<target>/, grown
# in place), with libFuzzer's RSS limit at 512 MB and a per-input timeout. A crash, a timeout or an
# out-of-memory stops the script; libFuzzer leaves the input in fuzz/artifacts/<target>/.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]      # all targets when none is named
#   FUZZ_JOBS=2 scripts/fuzz.sh 600 zmtp       # libFuzzer workers per target
#   FUZZ_RUNS=10000000 scripts/fuzz.sh 3600    # stop each target at N executions (or SECONDS)
#   FUZZ_NICE=5 scripts/fuzz.sh 600            # scheduling priority (default 19)
#   scripts/fuzz.sh --cmin [TARGET...]         # minimise the corpora (after a campaign)
#
# The test command (scripts/test.sh) does not run this: it replays the committed corpora through
# the same target bodies as ordinary stable tests (tests/it/fuzz_corpus.rs,
# protocol/tests/it/fuzz_corpus.rs).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup toolchain list | grep -q '^nightly'; then
  echo "scripts/fuzz.sh needs the nightly toolchain: rustup toolchain install nightly" >&2
  exit 1
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi

# No sanitizer (the workspace forbids unsafe code; panics, hangs and memory are what is looked
# for) and debug assertions on, so an arithmetic overflow is a finding.
BUILD=(--sanitizer none --debug-assertions --release)

cmin=false
MAX_CORPUS="${MAX_CORPUS:-300}"
if [ "${1:-}" = "--cmin" ]; then
  cmin=true
  shift
  seconds=0
else
  seconds="${1:-60}"
  [ $# -gt 0 ] && shift
fi
if [ $# -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cd fuzz && cargo +nightly fuzz list)
fi

(cd fuzz && nice -n 19 cargo +nightly fuzz build "${BUILD[@]}")

NICE="${FUZZ_NICE:-19}"
jobs=()
if [ -n "${FUZZ_RUNS:-}" ]; then
  jobs+=(-runs="$FUZZ_RUNS")
fi
if [ -n "${FUZZ_JOBS:-}" ]; then
  jobs+=(-jobs="$FUZZ_JOBS" -workers="$FUZZ_JOBS")
fi
mkdir -p fuzz/artifacts
for target in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$target"
  if $cmin; then
    # A set-cover merge on edges (fewest inputs covering what the corpus covers), then at most
    # MAX_CORPUS files (half the smallest, half the largest) so the committed corpora stay small.
    host=$(rustc +nightly -vV | sed -n 's/^host: //p')
    work="fuzz/corpus-work/$target"
    rm -rf "$work" && mkdir -p "$work"
    nice -n 19 "fuzz/target/$host/release/$target" -set_cover_merge=1 -use_counters=0 \
      -rss_limit_mb=512 -timeout=10 "$work" "fuzz/corpus/$target" >/dev/null 2>&1
    files=$(find "$work" -type f | wc -l)
    if [ "$files" -gt "$MAX_CORPUS" ]; then
      half=$((MAX_CORPUS / 2))
      ls -S "$work" | sed -n "$((half + 1)),$((files - half))p" |
        while read -r f; do rm "$work/$f"; done
    fi
    # Named inputs (seed-*, regression-* of a finding) keep their names and their place.
    find "fuzz/corpus/$target" -type f \( -name 'seed-*' -o -name 'regression-*' \) \
      -exec cp {} "$work/" \;
    rm -rf "fuzz/corpus/$target" && mv "$work" "fuzz/corpus/$target"
    echo "$target: $(find "fuzz/corpus/$target" -type f | wc -l) files"
    continue
  fi
  echo "== $target: ${seconds}s"
  log="fuzz/artifacts/$target.log"
  status=0
  (cd fuzz && nice -n "$NICE" cargo +nightly fuzz run "${BUILD[@]}" "$target" -- \
    -max_total_time="$seconds" -rss_limit_mb=512 -malloc_limit_mb=512 -timeout=10 -max_len=8192 \
    -print_final_stats=1 "${jobs[@]}") >"$log" 2>&1 || status=$?
  # libFuzzer's last status line (executions, coverage, features, corpus, exec/s, RSS).
  grep -E '^#[0-9]+[[:space:]]+DONE|^Done [0-9]+ runs|^stat::peak_rss_mb' "$log" || true
  if [ "$status" -ne 0 ]; then
    tail -40 "$log" >&2
    echo "fuzz target $target failed: see $log and fuzz/artifacts/$target/" >&2
    exit 1
  fi
done
