#!/usr/bin/env bash
# Lint and format check of the whole repository (the package, tests, benchmarks, scripts, recipes) and type check of
# lightning_trn/, with the settings in pyproject.toml. Runs in the XLA environment (the `lint` extra): mypy reads the
# types of torch 2.9 and torch-xla there. Every check runs; the exit code says whether any failed. To fix what ruff
# can: `ruff check --fix <dirs> && ruff format <dirs>` with the directories below.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
code=(lightning_trn tests benchmarks scripts recipes)
python -m ruff check "${code[@]}" || status=$?
python -m ruff format --check "${code[@]}" || status=$?
python -m mypy || status=$?  # the files come from [tool.mypy] in pyproject.toml
# mypy checks that each `type: ignore` names its error code; the reason after it (`  # why`) is checked here
if grep -rnE --include='*.py' 'type: ignore(\[[^]]*\])? *$' lightning_trn; then
  echo 'a `# type: ignore[code]` above has no reason after it (`# type: ignore[code]  # why`)' >&2
  status=1
fi
exit "$status"
