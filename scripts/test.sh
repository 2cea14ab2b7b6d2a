#!/usr/bin/env bash
# Runs both test suites: the XLA suite on XLA:CPU (current Python, torch 2.9 + torch-xla) and the native suite on
# the neuron stand-in (.venv-native/, torch 2.13): tests/standin plus the files shared by both backends (SHARED).
# The two run at the same time, the native one in the background with its output shown after the XLA suite's: each
# alone keeps one of CI's two cores busy on average (interpreters starting, one process at a time), so together they
# take about the time of the longer one. Both run to the end even if one fails; the exit code says if either did.
# The XLA suite also resumes checkpoints across the two environments (tests/test_cross_backend.py), so the native
# one must exist.
set -uo pipefail
cd "$(dirname "$0")/.."
SHARED=(tests/test_activation_checkpointing.py tests/test_zero1.py tests/test_sharded_save.py tests/test_fault_tolerance.py tests/test_host_syncs.py tests/test_ddp_training.py tests/test_torch_compile.py tests/test_compile_monitor.py tests/test_benchmarks_smoke.py tests/test_batch_containers.py tests/test_tied_weights.py tests/test_connector_hooks.py tests/test_autograd_start.py tests/test_resume_position.py tests/test_lightning_hooks.py tests/test_loader_properties.py tests/test_fabric.py tests/test_healthcheck.py tests/test_throughput.py tests/test_profiler.py tests/test_device_stats.py tests/test_distributed_checkpoint_read.py tests/test_recipe_llm_pretrained.py)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# its own temporary directory and no shared .pytest_cache, so the suites never write the same files
.venv-native/bin/python -m pytest --durations=15 -p no:cacheprovider --basetemp="$scratch/native" \
  tests/standin "${SHARED[@]}" >"$scratch/native.log" 2>&1 &
native=$!
status=0
LIGHTNING_TRN_REQUIRE_NATIVE=1 python -m pytest --durations=15 || status=$?
wait "$native" || status=$?
echo "================ native suite (.venv-native/, the neuron stand-in) ================"
cat "$scratch/native.log"
exit "$status"
