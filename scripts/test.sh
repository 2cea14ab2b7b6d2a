#!/usr/bin/env bash
# Runs both test suites over tests/: the XLA suite on XLA:CPU (current Python, torch 2.9 + torch-xla) and the native
# suite on the neuron stand-in (.venv-native/, torch 2.13). Each test module's marker (`both`, `xla_only`,
# `native_only`) says which suites run it; tests/conftest.py routes by it (docs/contributing.md).
# The two run at the same time, the native one in the background with its output shown after the XLA suite's: each
# alone keeps one of CI's two cores busy on average (interpreters starting, one process at a time), so together they
# take about the time of the longer one. Both run to the end even if one fails; the exit code says if either did.
# The XLA suite also resumes checkpoints across the two environments (tests/test_cross_backend.py), so the native
# one must exist.
set -uo pipefail
cd "$(dirname "$0")/.."

# ---- lint first: ruff and mypy on lightning_trn/ (scripts/lint.sh, under a minute); a finding fails the run ----
scripts/lint.sh || { echo "scripts/lint.sh failed: fix the findings above before the test suites run" >&2; exit 1; }

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# its own temporary directory and no shared .pytest_cache, so the suites never write the same files
.venv-native/bin/python -m pytest --durations=15 -p no:cacheprovider --basetemp="$scratch/native" tests \
  >"$scratch/native.log" 2>&1 &
native=$!
status=0
LIGHTNING_TRN_REQUIRE_NATIVE=1 python -m pytest --durations=15 tests || status=$?
wait "$native" || status=$?
echo "================ native suite (.venv-native/, the neuron stand-in) ================"
cat "$scratch/native.log"
exit "$status"
