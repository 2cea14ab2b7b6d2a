#!/usr/bin/env bash
# Runs both test suites: the XLA suite on XLA:CPU (current Python, torch 2.9 + torch-xla) and the native suite on
# the neuron stand-in (.venv-native/, torch 2.13): tests/standin plus the files shared by both backends (SHARED).
# Both run even if the first fails; the exit code says if either did. The XLA suite also resumes checkpoints across
# the two environments (tests/test_cross_backend.py), so the native one must exist.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
LIGHTNING_TRN_REQUIRE_NATIVE=1 python -m pytest --durations=15 || status=$?
SHARED=(tests/test_activation_checkpointing.py tests/test_zero1.py tests/test_fault_tolerance.py tests/test_host_syncs.py tests/test_ddp_training.py tests/test_torch_compile.py tests/test_compile_monitor.py tests/test_benchmarks_smoke.py tests/test_batch_containers.py tests/test_tied_weights.py tests/test_connector_hooks.py tests/test_autograd_start.py tests/test_resume_position.py tests/test_lightning_hooks.py tests/test_loader_properties.py tests/test_fabric.py tests/test_healthcheck.py tests/test_throughput.py tests/test_profiler.py tests/test_device_stats.py)
.venv-native/bin/python -m pytest --durations=15 tests/standin "${SHARED[@]}" || status=$?
exit "$status"
