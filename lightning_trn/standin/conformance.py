"""Conformance sweep: the `neuron` stand-in against the CPU over PyTorch's own OpInfo and ModuleInfo databases.

Every op in `op_db` and module in `module_db` (torch 2.13's `torch.testing._internal`) runs on both devices from the
same inputs (cloned storage by storage, so strides, offsets and aliasing are the same) and the same seed. Its outputs,
the arguments it mutates (in-place and `out=` variants, mutable aliases), module buffers and gradients must equal the
CPU's bit for bit, with the same dtype, shape, strides and device, and a view of an input on the CPU must be a view of
that input on `neuron` too. What still differs is listed in `KNOWN` with the reason, so a test can say "every op
passes or is known".

    python -m lightning_trn.standin.conformance [--sample K] [--ops NAME ...] [--no-modules] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PASS, DIFFERS, ERROR, SKIPPED = "pass", "differs", "error on neuron only", "skipped"
#: Samples compared per op and dtype (the first ones the OpInfo yields), and per module.
MAX_SAMPLES = 8
#: Dtypes tried, in order, for an op without float32 (bitwise ops, `view_as_real`, ...).
FALLBACK_DTYPES = (torch.int64, torch.complex64, torch.bool, torch.float64, torch.uint8, torch.int32, torch.float16)
SEED = 1234
DEVICE = "neuron"
ANY = (DEVICE, "cpu")  # where a tensor may be: inputs stay where the sample put them

_SPARSE = "sparse layouts: the stand-in has strided tensors only, as TorchNeuron (no sparse kernels)"
_RNN_LAYER = (
    "PyTorch's RNN layers run per device: on the CPU x W_ih^T + b_ih is one addmm over the whole sequence, on a "
    "PrivateUse1 device (as on CUDA) a bias-free matmul per step, the biases added in the fused cell: last-bit "
    "differences (the cells, which take the same path on both, equal the CPU's)"
)
#: Remaining accepted differences: op or module name -> why the stand-in differs from the CPU there.
KNOWN: dict[str, str] = {
    "addr": (
        "in-place on a 0-dim self the CPU raises and neuron broadcasts: addr_'s composite calls addr_out(self, self, "
        "...), whose CPU kernel tells in-place from out= by C++ reference identity, which no boxed call keeps"
    ),
    "mode": (
        "mode(out=) is a composite that refuses devices other than CPU, CUDA and XPU (as on TorchNeuron); "
        "mode without out= equals the CPU's"
    ),
    "nn.functional.linear_cross_entropy.chunked": (
        "PyTorch accumulates bfloat16 in float32 on cpu and cuda only (LinearCrossEntropyOptions."
        "_resolve_auto_acc_dtype), in bfloat16 on any other device; float32 equals the CPU's"
    ),
    "nn.functional.linear_cross_entropy.chunked_none": "as nn.functional.linear_cross_entropy.chunked",
    "sparse.mm.reduce": _SPARSE,
    "sparse.sampled_addmm": _SPARSE,
    "to_sparse": _SPARSE,
    "nn.GRU": _RNN_LAYER,
    "nn.LSTM": _RNN_LAYER,
}


@dataclass
class Result:
    """One op's or module's verdict over all its samples, dtypes and variants."""

    kind: str  # "op" or "module"
    name: str
    status: str = SKIPPED
    detail: str = ""
    compared: int = 0  # sample runs compared (a run per sample, dtype and variant)
    skips: list[str] = field(default_factory=list)  # why runs were not compared
    notes: list[str] = field(default_factory=list)  # how runs that passed were compared, where it is not plain

    def record(self, where: str, outcome: tuple[str, str] | None) -> None:
        """Fold one run's outcome (None: compared equal) into the verdict; the first failure's message is kept."""
        status, message = outcome or (PASS, "")
        if status == SKIPPED:
            self.skips.append(message)
            return
        self.compared += 1
        if status == PASS:
            self.status = PASS if self.status == SKIPPED else self.status
            if message and message not in self.notes:
                self.notes.append(message)
            return
        rank = {ERROR: 2, DIFFERS: 1}
        if rank[status] > rank.get(self.status, 0):
            self.status, self.detail = status, f"[{where}] {message}"

    def finish(self) -> None:
        """Set `detail` for a verdict without a failure: why nothing was compared, or how some runs were."""
        if self.status == SKIPPED:
            self.detail = self.skips[0] if self.skips else "no samples"
        elif self.status == PASS:
            self.detail = "; ".join([*self.notes, *(f"some runs skipped: {s}" for s in dict.fromkeys(self.skips))])


class Mismatch(Exception):
    """The stand-in's result differs from the CPU's (the message says where and how)."""


class CpuAlsoFails(Exception):
    """The CPU raises too: not a stand-in difference."""


# ---------------------------------------------------------------------------------------------- inputs
def _map(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`value` with `fn` applied to every tensor inside lists, tuples (incl. named ones) and dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, _map(v, fn)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        items = [_map(v, fn) for v in value]
        if hasattr(value, "_fields"):  # named tuple
            return type(value)(*items)
        return type(value)(items)
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors inside `value`, in `_map`'s order."""
    found: list[torch.Tensor] = []
    _map(value, found.append)
    return found


class _Cloner:
    """Copies tensors storage by storage, `neuron` ones to `device` and CPU ones on the CPU: same sizes, strides and
    offsets, and tensors that share storage (or are the same object) share it in the copy too. Device arguments
    naming `neuron` name `device`. `requires_grad` is kept when `grad`."""

    def __init__(self, device: str, grad: bool) -> None:
        self.device, self.grad = device, grad
        self.objects: dict[int, torch.Tensor] = {}
        self.storages: dict[tuple[str, int], torch.UntypedStorage] = {}

    def __call__(self, value: Any) -> Any:
        return _map(self._devices(value), self._tensor)

    def _devices(self, value: Any) -> Any:
        if isinstance(value, torch.device) and value.type == DEVICE:
            return torch.device(self.device)
        if isinstance(value, str) and value.split(":")[0] == DEVICE:  # to("neuron"), device="neuron:0"
            return self.device
        if isinstance(value, dict):
            return type(value)((k, self._devices(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size) and not hasattr(value, "_fields"):
            return type(value)(self._devices(v) for v in value)
        return value

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self.objects:
            return self.objects[id(t)]
        target = self.device if t.device.type == DEVICE else t.device
        with torch.no_grad():
            if t.layout != torch.strided:
                copy_ = t.detach().to(target, copy=True)
            else:
                storage = t.untyped_storage()
                key = (t.device.type, storage.data_ptr() if storage.nbytes() else -id(t))
                if key not in self.storages:
                    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                    self.storages[key] = raw.to(target, copy=True).untyped_storage()
                copy_ = torch.empty(0, dtype=t.dtype, device=target)
                copy_.set_(self.storages[key], t.storage_offset(), t.size(), t.stride())
        if self.grad and t.requires_grad:
            copy_.requires_grad_(True)
        self.objects[id(t)] = copy_
        return copy_


def _names_cpu(value: Any) -> bool:
    """Whether `value` holds a CPU tensor (such as `tensor_split`'s indices) or names the CPU device."""
    if isinstance(value, torch.Tensor):
        return value.device.type == "cpu"
    if isinstance(value, (torch.device, str)):
        return str(value).split(":")[0] == "cpu"
    if isinstance(value, dict):
        return any(_names_cpu(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_names_cpu(v) for v in value)


def _result_devices(value: Any) -> tuple[str, ...]:
    """Where results from a sample may be: on the device, or on the CPU too when the sample names the CPU."""
    return ANY if _names_cpu(value) else (DEVICE,)


def _storage_index(t: torch.Tensor, inputs: Sequence[torch.Tensor]) -> int | None:
    """Which input `t` shares memory with (a view, or the input itself), if any."""
    if not inputs or t.layout != torch.strided or t._is_zerotensor() or t.untyped_storage().nbytes() == 0:
        return None
    ptr = t.untyped_storage().data_ptr()
    for i, x in enumerate(inputs):
        if x.layout == torch.strided and not x._is_zerotensor() and x.untyped_storage().data_ptr() == ptr:
            return i
    return None


# ---------------------------------------------------------------------------------------------- comparison
def _first_lines(message: str, count: int = 3) -> str:
    """The first `count` non-blank lines of an error message, on one line (for the result table)."""
    return " ".join(line.strip() for line in message.strip().splitlines()[:count] if line.strip())


def _significant_strides(t: torch.Tensor) -> list[int]:
    """The strides that matter: those of dimensions longer than 1."""
    return [s for s, n in zip(t.stride(), t.size(), strict=True) if n > 1]


def _compare_tensor(
    where: str,
    cpu: torch.Tensor,
    dev: Any,
    cpu_inputs: Sequence[torch.Tensor],
    dev_inputs: Sequence[torch.Tensor],
    values: bool,
    devices: Sequence[str],
) -> None:
    """`compare` for one tensor: device, metadata, aliasing of the inputs, strides, then (if `values`) every value."""
    if not isinstance(dev, torch.Tensor):
        raise Mismatch(f"{where}: {type(dev).__name__} where the CPU gives a tensor")
    if dev.device.type not in (devices if cpu.device.type == "cpu" else (cpu.device.type,)):
        raise Mismatch(f"{where}: on {dev.device}, the CPU run's is on {cpu.device} (expected {' or '.join(devices)})")
    checks = (
        ("dtype", dev.dtype, cpu.dtype),
        ("shape", dev.shape, cpu.shape),
        ("layout", dev.layout, cpu.layout),
        ("requires_grad", dev.requires_grad, cpu.requires_grad),
        ("zero tensor", dev._is_zerotensor(), cpu._is_zerotensor()),
    )
    for what, got, expected in checks:
        if got != expected:
            raise Mismatch(f"{where}: {what} {got}, the CPU's is {expected}")
    if cpu.layout != torch.strided:
        return
    cpu_view, dev_view = _storage_index(cpu, cpu_inputs), _storage_index(dev, dev_inputs)
    if cpu_view != dev_view:
        said: dict[int | None, str] = {None: "a new tensor"}
        raise Mismatch(
            f"{where}: {said.get(dev_view, f'a view of input {dev_view}')} where the CPU gives "
            f"{said.get(cpu_view, f'a view of input {cpu_view}')}"
        )
    if cpu.numel() > 1 and _significant_strides(cpu) != _significant_strides(dev):
        raise Mismatch(f"{where}: strides {dev.stride()}, the CPU's are {cpu.stride()} (shape {tuple(cpu.shape)})")
    if cpu_view is not None and cpu.numel() and dev.storage_offset() != cpu.storage_offset():
        raise Mismatch(f"{where}: storage offset {dev.storage_offset()}, the CPU's is {cpu.storage_offset()}")
    if values:
        try:
            torch.testing.assert_close(dev.detach().cpu(), cpu.detach(), rtol=0, atol=0, equal_nan=True)
        except AssertionError as err:
            raise Mismatch(f"{where}: {_first_lines(str(err))}") from None


def compare(
    where: str,
    cpu: Any,
    dev: Any,
    cpu_inputs: Sequence[torch.Tensor] = (),
    dev_inputs: Sequence[torch.Tensor] = (),
    values: bool = True,
    devices: Sequence[str] = (DEVICE,),
) -> None:
    """Raise `Mismatch` where `dev` (the stand-in's result) differs from `cpu`; views must alias the same input, and
    a tensor the CPU run has on the CPU must be on one of `devices`."""
    if isinstance(cpu, torch.Tensor):
        _compare_tensor(where, cpu, dev, cpu_inputs, dev_inputs, values, devices)
    elif isinstance(cpu, (list, tuple)) and not isinstance(cpu, torch.Size):
        if not isinstance(dev, (list, tuple)) or len(dev) != len(cpu):
            raise Mismatch(f"{where}: {type(dev).__name__} where the CPU gives {type(cpu).__name__} of {len(cpu)}")
        for i, (c, d) in enumerate(zip(cpu, dev, strict=True)):
            compare(f"{where}[{i}]", c, d, cpu_inputs, dev_inputs, values, devices)
    elif isinstance(cpu, dict):
        if not isinstance(dev, dict) or dev.keys() != cpu.keys():
            raise Mismatch(f"{where}: {dev!r:.80} where the CPU gives keys {list(cpu)}")
        for k in cpu:
            compare(f"{where}[{k!r}]", cpu[k], dev[k], cpu_inputs, dev_inputs, values, devices)
    elif isinstance(cpu, float) and cpu != cpu:
        if not (isinstance(dev, float) and dev != dev):
            raise Mismatch(f"{where}: {dev!r} where the CPU gives nan")
    elif type(dev) is not type(cpu) or dev != cpu:
        raise Mismatch(f"{where}: {dev!r:.80} where the CPU gives {cpu!r:.80}")


# ---------------------------------------------------------------------------------------------- running both
class _SeededOps(TorchDispatchMode):
    """Records whether any op that draws random numbers (`nondeterministic_seeded`) ran."""

    def __init__(self) -> None:
        super().__init__()
        self.random = False

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.random = self.random or torch.Tag.nondeterministic_seeded in func.tags
        return func(*args, **(kwargs or {}))


def _seed(seed: int) -> None:
    """Seeds the CPU generator and the neuron devices' generators alike: what `torch.manual_seed` does here, without
    its queued seeding of CUDA, XPU and MTIA, each of which records the Python stack (half the sweep's time)."""
    torch.default_generator.manual_seed(seed)
    getattr(torch, DEVICE).manual_seed_all(seed)


def _manual_seed(seed: int) -> torch.Generator:
    """`torch.manual_seed` for the sweep's duration (OpInfo's sample iterators reseed per sample): `_seed`."""
    _seed(seed)
    return torch.default_generator


def _call(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`fn(*args, **kwargs)` from the same random state on either device."""
    _seed(SEED)
    return fn(*args, **kwargs)


def _draws_random(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether `fn` on CPU clones of `args`/`kwargs` draws random numbers."""
    mode = _SeededOps()
    try:
        args, kwargs = _Cloner("cpu", False)([list(args), dict(kwargs)])
        with mode:
            _call(fn, args, kwargs)
    except Exception:  # noqa: BLE001 (the run itself was compared before; only the flag matters)
        pass
    return mode.random


def _run_both(
    fns: tuple[Callable[..., Any], Callable[..., Any]],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    grad: bool,
) -> tuple[tuple[list, Any], tuple[list, Any]]:
    """The (input tensors after the call, result) of `fns[0]` on CPU clones of `args`/`kwargs` and of `fns[1]` on
    neuron clones; `CpuAlsoFails` if both raise, `Mismatch` if only the CPU does."""
    runs = []
    for device in ("cpu", DEVICE):
        a, k = _Cloner(device, grad)([list(args), dict(kwargs)])
        runs.append((a, k, _tensors((a, k))))
    (cpu_args, cpu_kwargs, cpu_inputs), (dev_args, dev_kwargs, dev_inputs) = runs
    try:
        expected = _call(fns[0], cpu_args, cpu_kwargs)
    except Exception as err:
        try:
            _call(fns[1], dev_args, dev_kwargs)
        except Exception:  # noqa: BLE001
            raise CpuAlsoFails(f"raises on the CPU too: {_first_lines(str(err), 1):.120}") from None
        raise Mismatch(
            f"neuron returns where the CPU raises {type(err).__name__}: {_first_lines(str(err), 1)}"
        ) from err
    got = _call(fns[1], dev_args, dev_kwargs)
    return (cpu_inputs, expected), (dev_inputs, got)


@contextlib.contextmanager
def _filled_new_memory() -> Iterator[None]:
    """New memory (`empty`, resized tensors) holds NaN on both devices, not what was there before: some CPU kernels
    read what they leave unwritten (`linalg.lstsq` with `gelsy` on a wide matrix)."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # fills new memory (fill_uninitialized_memory)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _outcome(run: Callable[[], None], filled: bool = False) -> tuple[str, str] | None:
    """Runs one comparison: None when equal, else (status, message). A difference is tried again with new memory
    NaN-filled on both devices: kernels that read memory they leave unwritten differ from run to run on the CPU too."""
    try:
        with _filled_new_memory() if filled else contextlib.nullcontext():
            run()
    except CpuAlsoFails as err:
        return SKIPPED, str(err)
    except Mismatch as err:
        if not filled and _outcome(run, filled=True) is None:
            return PASS, "reads memory it leaves unwritten (so does the CPU): compared with new memory NaN-filled"
        return DIFFERS, str(err)
    except Exception as err:  # noqa: BLE001 (anything the stand-in raises that the CPU did not)
        return ERROR, f"{type(err).__name__}: {_first_lines(str(err), 2):.200}"
    return None


def _compare_gradients(where: str, cpu_out: Any, dev_out: Any, cpu_wrt: list, dev_wrt: list) -> None:
    """Backward from the differentiable outputs with the same random gradient; compare what reaches `*_wrt`."""
    pairs = [
        (c, d)
        for c, d in zip(_tensors(cpu_out), _tensors(dev_out), strict=True)
        if c.requires_grad and (c.is_floating_point() or c.is_complex())
    ]
    wrt = [(c, d) for c, d in zip(cpu_wrt, dev_wrt, strict=True) if c.requires_grad]
    if not pairs or not wrt:
        return
    generator = torch.Generator().manual_seed(SEED)
    grads = [torch.randn(c.shape, dtype=c.dtype, generator=generator) for c, _ in pairs]
    try:
        expected = torch.autograd.grad([c for c, _ in pairs], [c for c, _ in wrt], grads, allow_unused=True)
    except Exception:  # noqa: BLE001 (no backward on the CPU: nothing to compare)
        return
    got = torch.autograd.grad(
        [d for _, d in pairs], [d for _, d in wrt], [g.to(DEVICE) for g in grads], allow_unused=True
    )
    compare(f"{where} gradient", list(expected), list(got))


# ---------------------------------------------------------------------------------------------- ops
def op_name(op: Any) -> str:
    """An OpInfo's unique name: `name` or `name.variant`."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def op_dtypes(op: Any) -> list[torch.dtype]:
    """float32 (or the first supported of `FALLBACK_DTYPES`) and bfloat16 where the OpInfo supports it on the CPU."""
    supported = op.supported_dtypes("cpu")
    first = next((d for d in (torch.float32, *FALLBACK_DTYPES) if d in supported), None)
    chosen = [first] if first is not None else []
    return chosen + ([torch.bfloat16] if torch.bfloat16 in supported and first != torch.bfloat16 else [])


def _out_like(value: Any, resize: bool) -> Any:
    """An `out=` argument for a result like `value`: zeros of its shape and strides, or empty ones to be resized."""
    if isinstance(value, torch.Tensor):
        if resize:
            return torch.empty(0, dtype=value.dtype, device=DEVICE)
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=DEVICE).zero_()
    return tuple(_out_like(v, resize) for v in value)


def _check_sample(op: Any, sample: Any, values: bool, result: Result, where: str) -> None:
    """One sample through the functional, in-place and out= variants; each is a run recorded in `result`."""
    args, kwargs = [sample.input, *sample.args], dict(sample.kwargs)
    state: dict[str, Any] = {}

    def functional() -> None:
        (cpu_in, expected), (dev_in, got) = _run_both((op, op), args, kwargs, grad=True)
        state["expected"] = expected
        try:
            compare("output", expected, got, cpu_in, dev_in, values, _result_devices((args, kwargs)))
            compare("inputs after the call", cpu_in, dev_in, values=values, devices=ANY)
        except Mismatch:
            if _draws_random(op, args, kwargs):
                raise CpuAlsoFails("random: results differ from the CPU's under the same seed") from None
            raise
        if values:
            _compare_gradients(
                "output", sample.output_process_fn_grad(expected), sample.output_process_fn_grad(got), cpu_in, dev_in
            )

    def inplace() -> None:
        variant = op.inplace_variant
        (cpu_in, expected), (dev_in, got) = _run_both((variant, variant), args, kwargs, grad=False)
        if (expected is cpu_in[0]) != (got is dev_in[0]):
            raise Mismatch("in-place result: not self" if expected is cpu_in[0] else "in-place result: self")
        compare("in-place self and inputs after the call", cpu_in, dev_in, values=values, devices=ANY)

    def out(resize: bool) -> Callable[[], None]:
        def run() -> None:
            expected = state.get("expected")
            tensors = _tensors(expected)
            # out= takes a tensor result, or a sequence of tensors and nothing else
            usable = tensors and (isinstance(expected, torch.Tensor) or len(tensors) == len(expected or ()))
            if not usable:
                raise CpuAlsoFails("no tensor result to give as out=")
            (cpu_in, returned), (dev_in, got) = _run_both(
                (op, op), args, {**kwargs, "out": _out_like(expected, resize)}, grad=False
            )
            compare("out= result", returned, got, cpu_in, dev_in, values, _result_devices((args, kwargs)))
            compare("out= tensors and inputs after the call", cpu_in, dev_in, values=values, devices=ANY)

        return run

    result.record(f"{where} functional", _outcome(functional))
    if op.inplace_variant is not None:
        result.record(f"{where} in-place", _outcome(inplace))
    if op.supports_out:
        result.record(f"{where} out=", _outcome(out(resize=False)))
        result.record(f"{where} out= resized", _outcome(out(resize=True)))


def _made_on_device(make: Callable[[str], Iterable[Any]]) -> list:
    """The first `MAX_SAMPLES` inputs `make(device)` gives on the device (seeded): `CpuAlsoFails` if making them fails
    on the CPU too, else the device's error."""
    _seed(0)
    try:
        return list(itertools.islice(make(DEVICE), MAX_SAMPLES))
    except Exception as err:
        try:
            list(itertools.islice(make("cpu"), MAX_SAMPLES))
        except Exception:  # noqa: BLE001
            raise CpuAlsoFails(f"making inputs fails on the CPU too: {_first_lines(str(err), 1):.120}") from None
        raise


def _record_made(result: Result, where: str, make: Callable[[str], Iterable[Any]]) -> list:
    """`_made_on_device(make)`, or [] with the failure recorded in `result`."""
    made: list = []
    outcome = _outcome(lambda: made.extend(_made_on_device(make)))
    if outcome is not None:
        result.record(where, outcome)
    return made


def check_op(op: Any) -> Result:
    """Compare one OpInfo on `neuron` against the CPU over its first samples in each dtype."""
    result = Result("op", op_name(op))
    values = not op.has_nondeterministic_output
    dtypes = op_dtypes(op)
    if not dtypes:
        result.skips.append("no CPU dtypes")
    for dtype in dtypes:
        requires_grad = op.supports_autograd and dtype in op.supported_backward_dtypes("cpu")
        dtype_name = str(dtype).removeprefix("torch.")
        samples = _record_made(
            result,
            f"{dtype_name} sample inputs",
            functools.partial(op.sample_inputs, dtype=dtype, requires_grad=requires_grad),
        )
        for i, sample in enumerate(samples):
            _check_sample(op, sample, values, result, f"{dtype_name} sample {i}")
    if not values and result.status == PASS:
        result.status = SKIPPED
        result.detail = "values are uninitialized memory: shapes, dtypes, strides and devices compared"
    else:
        result.finish()
    return result


# ---------------------------------------------------------------------------------------------- modules
def _check_module_input(module_info: Any, module_input: Any) -> None:
    """Train-mode forward and backward (then eval-mode forward where the module has buffers) on both devices."""
    built = []
    for device in ("cpu", DEVICE):
        args, kwargs = _Cloner(device, False)(
            [list(module_input.constructor_input.args), dict(module_input.constructor_input.kwargs)]
        )
        _seed(0)  # the same initial parameters
        try:
            built.append(module_info.module_cls(*args, **kwargs).to(torch.float32).to(device))
        except Exception as err:
            if device == "cpu":
                raise CpuAlsoFails(f"construction fails on the CPU: {_first_lines(str(err), 1):.120}") from None
            raise
    cpu, dev = built
    if not module_info.is_lazy:  # lazy modules make their parameters in the first forward
        compare("initial state", cpu.state_dict(), dev.state_dict())
    args, kwargs = module_input.forward_input.args, module_input.forward_input.kwargs
    (cpu_in, expected), (dev_in, got) = _run_both((cpu.train(), dev.train()), args, kwargs, grad=True)
    cpu_state = [*cpu_in, *cpu.parameters(), *cpu.buffers()]
    dev_state = [*dev_in, *dev.parameters(), *dev.buffers()]
    try:
        compare("train output", expected, got, cpu_state, dev_state)
        compare("inputs after forward", cpu_in, dev_in, devices=ANY)
        compare("buffers after forward", dict(cpu.named_buffers()), dict(dev.named_buffers()))
    except Mismatch:
        if _draws_random(copy.deepcopy(cpu), args, kwargs):
            raise CpuAlsoFails("random in train mode: results differ from the CPU's under the same seed") from None
        raise
    _compare_gradients("train output", expected, got, [*cpu_in, *cpu.parameters()], [*dev_in, *dev.parameters()])
    if any(True for _ in cpu.buffers()):
        with torch.no_grad():
            (cpu_in, expected), (dev_in, got) = _run_both((cpu.eval(), dev.eval()), args, kwargs, grad=False)
        compare("eval output", expected, got, [*cpu_in, *cpu.buffers()], [*dev_in, *dev.buffers()])


def check_module(module_info: Any) -> Result:
    """Compare one ModuleInfo's modules on `neuron` against the CPU (float32) over its first inputs."""
    result = Result("module", module_info.name)
    inputs = _record_made(
        result,
        "module inputs",
        lambda device: module_info.module_inputs_func(
            module_info, device=device, dtype=torch.float32, requires_grad=True, training=True
        ),
    )
    for i, module_input in enumerate(inputs):
        desc = f" ({module_input.desc})" if module_input.desc else ""
        result.record(f"input {i}{desc}", _outcome(functools.partial(_check_module_input, module_info, module_input)))
    result.finish()
    return result


# ---------------------------------------------------------------------------------------------- the sweep
def databases() -> tuple[list, list]:
    """PyTorch's `op_db` and `module_db` (loading the stand-in first). Importing them would freeze `torch.backends`'
    flags (test-suite setup in `common_utils`, after which Lightning cannot set `cudnn.benchmark`): not here."""
    import lightning_trn.standin  # noqa: F401 (loads the stand-in)

    with mock.patch.object(torch.backends, "disable_global_flags", lambda: None):
        from torch.testing._internal.common_methods_invocations import op_db
        from torch.testing._internal.common_modules import module_db
    return op_db, module_db


def select(items: Iterable[Any], name: Callable[[Any], str], sample: int, names: Iterable[str] | None) -> list:
    """Every `sample`-th item by name (all for 1), or those named in `names`."""
    ordered = sorted(items, key=name)
    if names is not None:
        wanted = set(names)
        return [item for item in ordered if name(item) in wanted]
    return ordered[::sample]


def sweep(
    sample: int = 1,
    names: Iterable[str] | None = None,
    ops: bool = True,
    modules: bool = True,
    progress: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Run the conformance checks over every `sample`-th op and module (or the ones in `names`)."""
    op_db, module_db = databases()
    names = None if names is None else list(names)
    unknown = set(names or ()) - {op_name(op) for op in op_db} - {m.name for m in module_db}
    if unknown:
        raise ValueError(f"no OpInfo or ModuleInfo is named {sorted(unknown)}")
    checks: list[tuple[Callable[[Any], Result], Any]] = []
    if ops:
        checks += [(check_op, op) for op in select(op_db, op_name, sample, names)]
    if modules:
        checks += [(check_module, m) for m in select(module_db, lambda m: m.name, sample, names)]
    results = []
    devices = range(torch.get_device_module(DEVICE).device_count())
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    # Each sample-input iterator, and an OpInfo for its skips, looks for the unittest test running it by
    # `inspect.stack()`, which reads the source line of every frame: under pytest's deep stack that was three quarters
    # of the sweep. A sweep runs in no unittest test, so the answer is None (and if a caller's test were found, its
    # name would reseed the samples: the results would depend on the caller). The iterators also reseed each sample
    # with `torch.manual_seed`, whose queued CUDA, XPU and MTIA seeding records the stack each time: `_seed` instead.
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        stack.enter_context(torch.random.fork_rng(devices, device_type=DEVICE))  # keeps the caller's RNG state
        for module in (common_utils, core):
            stack.enter_context(mock.patch.object(module, "extract_test_fn", lambda: None))
        stack.enter_context(mock.patch.object(torch, "manual_seed", _manual_seed))
        warnings.simplefilter("ignore")
        for check, item in checks:
            results.append(check(item))
            if progress is not None:
                progress(results[-1])
    return results


def summary(results: Sequence[Result]) -> dict[str, dict[str, int]]:
    """Counts by kind and status."""
    counts: dict[str, dict[str, int]] = {}
    for r in results:
        counts.setdefault(r.kind, {}).setdefault(r.status, 0)
        counts[r.kind][r.status] += 1
    return counts


def unexpected(results: Sequence[Result]) -> list[Result]:
    """Results that differ or fail on neuron without being in `KNOWN`."""
    return [r for r in results if r.status in (DIFFERS, ERROR) and r.name not in KNOWN]


def _cell(text: str) -> str:
    """`text` as one markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(results: Sequence[Result]) -> str:
    """The result table: counts, then every op and module that does not pass plainly (differs, errors, skipped, or
    passes only as a note says), grouped by status and sorted."""
    lines = ["| | " + " | ".join((PASS, DIFFERS, ERROR, SKIPPED)) + " |", "|---|---|---|---|---|"]
    for kind, counts in sorted(summary(results).items()):
        cells = " | ".join(str(counts.get(s, 0)) for s in (PASS, DIFFERS, ERROR, SKIPPED))
        lines.append(f"| {kind}s | {cells} |")
    lines += ["", "| status | kind | name | known reason | first mismatch or reason |", "|---|---|---|---|---|"]
    order = {ERROR: 0, DIFFERS: 1, SKIPPED: 2, PASS: 3}
    listed = (r for r in results if r.status != PASS or r.notes)
    for r in sorted(listed, key=lambda r: (order[r.status], r.kind, r.name)):
        detail = "; ".join(r.notes) if r.status == PASS else r.detail
        lines.append(f"| {r.status} | {r.kind} | `{r.name}` | {_cell(KNOWN.get(r.name, ''))} | {_cell(detail)} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: run the sweep, print each op/module that does not pass, the counts and time; 1 if any is unexpected."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_trn.standin.conformance", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--sample", type=int, default=1, metavar="K", help="every K-th op and module by name")
    parser.add_argument("--ops", nargs="+", metavar="NAME", help="only these ops/modules (OpInfo or ModuleInfo names)")
    parser.add_argument("--no-modules", action="store_true", help="ops only")
    parser.add_argument("--no-ops", action="store_true", help="modules only")
    parser.add_argument("--markdown", metavar="PATH", help="write the result table there")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every result, passes too")
    args = parser.parse_args(argv)
    if args.sample < 1:
        parser.error("--sample must be at least 1")

    def report(r: Result) -> None:
        if args.verbose or r.status in (DIFFERS, ERROR):
            known = " (known)" if r.name in KNOWN else ""
            print(f"{r.status}{known}: {r.kind} {r.name}: {r.detail}", flush=True)

    start = time.perf_counter()
    try:
        results = sweep(args.sample, args.ops, not args.no_ops, not args.no_modules, report)
    except ValueError as err:
        parser.error(str(err))
    elapsed = time.perf_counter() - start
    for kind, counts in sorted(summary(results).items()):
        print(f"{kind}s: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    print(f"{len(results)} checked in {elapsed:.0f} s")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results))
    bad = unexpected(results)
    if bad:
        print(f"not in KNOWN: {', '.join(r.name for r in bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
