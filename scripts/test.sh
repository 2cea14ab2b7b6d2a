#!/usr/bin/env bash
# Runs both test suites over tests/: the XLA suite on XLA:CPU (current Python, torch 2.9 + torch-xla) and the native
# suite on the neuron stand-in (.venv-native/, torch 2.13). Each test module's marker (`both`, `xla_only`,
# `native_only`) says which suites run it; tests/conftest.py routes by it (docs/contributing.md).
# The two run at the same time, each on two pytest-xdist workers, the native one in the background with its output
# shown after the XLA suite's. Both run to the end even if one fails; the exit code says if either did.
# The XLA suite also resumes checkpoints across the two environments (tests/checkpoint/test_cross_backend.py), so the native
# one must exist.
# Children that tests launch start from a warm interpreter (tests/warm_python.py: torch and Lightning imported once,
# each child a fork of it); LIGHTNING_TRN_TEST_COLD=1 starts every child fresh instead.
# `scripts/test.sh --quick` is the inner loop: both suites without the `slow` end-to-end modules (recipes,
# multi-process kill/resume runs, packaging), about 5 minutes; CI runs everything.
# The `numerics` tests (float32 equality with a reference, tolerances from tests/tolerance.py) then run again in the
# native suite under a second ATEN_CPU_CAPABILITY (`default`, or `avx2` when the first was `default`), right after
# it: the kernels a CPU's instruction set selects change float32 summation orders, and a tolerance must hold on every
# CPU. Every measured comparison's ratio to its bound is printed at the end (LIGHTNING_TRN_TOLERANCE_LOG).
set -uo pipefail
cd "$(dirname "$0")/.."
select=()
if [ "${1:-}" = "--quick" ]; then
  select=(-m "not slow")
elif [ $# -gt 0 ]; then
  echo "usage: scripts/test.sh [--quick]" >&2
  exit 2
fi

# two pytest-xdist workers per suite, each test module on one worker (its module fixtures run once): while both
# suites run, each has a core; when one ends, the other has both. Modules go out in collection order, which
# tests/conftest.py starts with the slow ones, so a suite does not end on a long module with one worker idle.
workers=(-n 2 --dist loadfile --no-loadscope-reorder)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export LIGHTNING_TRN_TOLERANCE_LOG="$scratch/tolerance.jsonl"
# lint beside the suites (ruff on the repository, mypy on lightning_trn/: scripts/lint.sh); a finding fails the run
scripts/lint.sh >"$scratch/lint.log" 2>&1 &
lint=$!
if [ "${ATEN_CPU_CAPABILITY:-}" = default ]; then second=avx2; else second=default; fi
numerics=(-m numerics)
if [ ${#select[@]} -gt 0 ]; then numerics=(-m "numerics and not slow"); fi
# its own temporary directory and no shared .pytest_cache, so the suites never write the same files; the numerics
# tests' second run follows the native suite in the same background job, beside the (longer) XLA suite
(
  code=0
  .venv-native/bin/python -m pytest "${workers[@]}" --durations=15 -p no:cacheprovider --basetemp="$scratch/native" \
    "${select[@]}" tests >"$scratch/native.log" 2>&1 || code=1
  ATEN_CPU_CAPABILITY=$second .venv-native/bin/python -m pytest "${workers[@]}" -p no:cacheprovider \
    --basetemp="$scratch/numerics" "${numerics[@]}" tests >"$scratch/numerics.log" 2>&1 || code=1
  exit $code
) &
native=$!
status=0
LIGHTNING_TRN_REQUIRE_NATIVE=1 python -m pytest "${workers[@]}" --durations=15 -p no:cacheprovider \
  --basetemp="$scratch/xla" "${select[@]}" tests || status=$?
wait "$native" || status=$?
echo "================ native suite (.venv-native/, the neuron stand-in) ================"
cat "$scratch/native.log"
echo "================ numerics tests again, native suite, ATEN_CPU_CAPABILITY=$second ================"
cat "$scratch/numerics.log"
python tests/tolerance.py "$LIGHTNING_TRN_TOLERANCE_LOG"
echo "================ scripts/lint.sh ================"
cat "$scratch/lint.log"
wait "$lint" || { status=1; echo "scripts/lint.sh failed: fix the findings above" >&2; }
exit "$status"
