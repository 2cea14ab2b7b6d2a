"""Pipeline parallelism: a model split into stages by layers, run by a schedule of `torch.distributed.pipelining`.

`pipeline_split(model, loss_fn, strategy)` is what a LightningModule calls in `configure_model` (and a Fabric
`parallelize_fn`): it keeps on this rank only the parts of `model` its stages hold (in place, so parameter names,
and with them checkpoints, stay those of the unsplit model) and returns a `Pipeline`, whose `parts` the user then
parallelizes (tensor parallel, FSDP2) and whose `step` runs one batch through the schedule. Without pipeline
parallelism (one stage, or another strategy: the reference run on a GPU or CPU) `step` is the model's forward and
the loss, and Lightning's backward follows as usual, so one LightningModule serves both.

The split follows TorchTitan's convention for Llama: the model's direct children registered before its stack of
layers (the embedding) go to the first stage, the layers are divided evenly (earlier stages take one more where they
do not divide), the children after the stack (norm, head) go to the last stage. A stack nested deeper (`layers=
"model.layers"`, Hugging Face's causal LMs) is split the same way at each level of its path, and modules without
state (rotary embeddings) stay on every stage. A child a rank does not hold is None, and a layer it does not hold is
missing from the stack (a `ModuleList` or `ModuleDict` that keeps the other layers' names), so the model's `forward`
must skip what it lacks (`x = self.embedding(x) if self.embedding is not None else x`, a loop over the layers it
has), as TorchTitan's models do (the LLM recipe's `StageLM` does it for Hugging Face's).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module, ModuleDict, ModuleList

from lightning_trn.core.parallel.model_parallel import _unwrapped_name

#: schedules with one stage per rank; the others run `stages_per_rank` stages on each rank
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
#: schedules whose stages go down the ranks and back up (a "V"): rank r holds stages r and 2 * ranks - 1 - r
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
#: the schedules lightning_trn runs and tests (names of `torch.distributed.pipelining.schedules.get_schedule_class`)
SCHEDULES = (*SINGLE_STAGE_SCHEDULES, "Interleaved1F1B", "ZBVZeroBubble")


def refuse_evaluation(schedule: str | None) -> None:
    """Refuse validation, testing and prediction under a V schedule, whose `eval()` torch runs with backward actions
    (checked when a fit that validates starts, and at the first evaluation batch)."""
    if schedule in V_SCHEDULES:
        raise NotImplementedError(
            f"pipeline_schedule={schedule!r} trains, but does not validate, test or predict: torch's V schedules run "
            "their backward actions in `eval()` too (torch 2.13: \"can't steal_bwd_input if this stage doesn't have "
            'backward"). Validate with another schedule (1F1B, Interleaved1F1B), or train with '
            "`limit_val_batches=0` and evaluate the checkpoint on another layout (checkpoints resume on any)."
        )


LossFn = Callable[[Any, Any], Tensor]


def stages_of_rank(schedule: str, rank: int, ranks: int, stages_per_rank: int) -> list[int]:
    """The stage indices one pipeline rank holds: looped (rank r holds r, r + ranks, ...) or, for V schedules, r and
    2 * ranks - 1 - r."""
    if schedule in SINGLE_STAGE_SCHEDULES:
        return [rank]
    if schedule in V_SCHEDULES:
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(stages_per_rank)]


def stage_rank(schedule: str, stage: int, ranks: int, stages_per_rank: int) -> int:
    """The pipeline rank that holds `stage`."""
    return next(r for r in range(ranks) if stage in stages_of_rank(schedule, r, ranks, stages_per_rank))


def _layers_name(model: Module, layers: str | None) -> str:
    """The dotted path of the stack of layers in `model`, checked to be a ModuleList or ModuleDict."""
    if layers is not None:
        try:
            stack = model.get_submodule(layers)
        except AttributeError:
            stack = None
        if not isinstance(stack, (ModuleList, ModuleDict)):
            raise ValueError(f"pipeline_split: `model.{layers}` is not a ModuleList or ModuleDict of layers.")
        return layers
    stacks = [name for name, child in model.named_children() if isinstance(child, (ModuleList, ModuleDict))]
    if len(stacks) != 1:
        raise ValueError(
            f"pipeline_split: {type(model).__name__} has {len(stacks)} ModuleList/ModuleDict children "
            f"({', '.join(stacks) or 'none'}); name the stack of layers to split with `layers=`."
        )
    return stacks[0]


def _holds_no_state(module: Module) -> bool:
    """No parameters and nothing in its state dict: a module (rotary embeddings, an activation) every stage may keep
    without changing what the stages' checkpoints hold."""
    return next(module.parameters(), None) is None and not module.state_dict()


def stage_contents(model: Module, num_stages: int, layers: str | None = None) -> list[list[str]]:
    """The names of `model`'s parts each stage holds: modules beside the stack by dotted name, layers as
    `<stack>.<key>` (the split TorchTitan's `generate_llm_fqn_per_model_part` makes, with layers divided evenly).

    At each level of the stack's path (`model.layers` in a Hugging Face causal LM: the stack inside `model`, beside
    `lm_head`), the modules registered before the path go to the first stage and those after it to the last; a
    module that holds no state (`_holds_no_state`: rotary embeddings, which every layer reads) goes to every stage."""
    stack_path = _layers_name(model, layers)
    keys = list(model.get_submodule(stack_path)._modules)
    if len(keys) < num_stages:
        raise ValueError(
            f"pipeline_split: {len(keys)} layers in `{stack_path}` cannot fill {num_stages} stages: every stage needs "
            "at least one layer. Use fewer stages (pipeline_parallel_size x stages per rank)."
        )
    before: list[str] = []
    after: list[str] = []
    module, prefix = model, ""
    for step in stack_path.split("."):
        names = [name for name, _ in module.named_children()]
        position = names.index(step)
        before += [prefix + name for name in names[:position]]
        after[:0] = [prefix + name for name in names[position + 1 :]]  # inner levels' first: the order they run
        module, prefix = module.get_submodule(step), f"{prefix}{step}."
    everywhere = {name for name in (*before, *after) if _holds_no_state(model.get_submodule(name))}
    per_stage, extra = divmod(len(keys), num_stages)
    contents: list[list[str]] = []
    start = 0
    for stage in range(num_stages):
        count = per_stage + (1 if stage < extra else 0)
        stage_layers = [f"{stack_path}.{key}" for key in keys[start : start + count]]
        start += count
        first, last = stage == 0, stage == num_stages - 1
        contents.append(
            [
                *(name for name in before if first or name in everywhere),
                *stage_layers,
                *(name for name in after if last or name in everywhere),
            ]
        )
    return contents


def tied_across_stages(model: Module, contents: list[list[str]]) -> list[dict[int, str]]:
    """The parameters that modules of different stages share (an output head tied to the token embedding): for each,
    the name it has in every stage that holds it. Split, each of those stages trains a copy of its own; the copies
    stay one weight only if their gradients are summed before every update (`Pipelining.reduce_tied_gradients`, as
    Megatron-LM all-reduces the embedding's over its first and last stage)."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    ties = []
    for shared in names.values():
        holders: dict[int, str] = {}
        for name in shared:
            for stage, held in enumerate(contents):
                if any(name.startswith(f"{module}.") for module in held):
                    holders.setdefault(stage, name)
        if len(holders) > 1:
            ties.append(holders)
    return ties


def _keep(model: Module, stack_path: str, held: set[str]) -> None:
    """Drop from `model` (in place) what `held` does not name: modules beside the stack's path become None, layers
    leave the stack (whose other layers keep their names)."""
    module, prefix = model, ""
    for step in stack_path.split("."):
        for name in list(module._modules):
            if name != step and prefix + name not in held:
                module._modules[name] = None
        child = module._modules[step]
        assert child is not None
        module, prefix = child, f"{prefix}{step}."
    for key in list(module._modules):
        if prefix + key not in held:
            del module._modules[key]


def _shallow_copy(module: Module) -> Module:
    """A copy of `module` sharing its submodules, whose own list of them can change without changing `module`'s."""
    view = copy.copy(module)
    view._modules = dict(module._modules)
    return view


def _part(model: Module, stack_path: str, held: set[str]) -> Module:
    """A view of `model` holding only `held`, for a rank that runs several stages: shallow copies of `model` and of
    the modules down the stack's path, sharing every other submodule (so the parameters and their names in `model`
    stay one)."""
    part = module = _shallow_copy(model)
    for step in stack_path.split("."):
        child = module._modules[step]
        assert child is not None
        module._modules[step] = module = _shallow_copy(child)
    _keep(part, stack_path, held)
    return part


def _distinct(tensors: Iterable[Tensor]) -> list[Tensor]:
    """`tensors` without repeats of one object, in order."""
    return list({id(tensor): tensor for tensor in tensors}.values())


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local shard, or the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@contextlib.contextmanager
def _gradients_kept(parts: Sequence[Module]) -> Iterator[None]:
    """Keep the gradients of `parts` through a block that may set them to None, adding back the ones it dropped (a
    gradient the block made meanwhile is summed with the kept one). FSDP modules are resharded first, as torch's
    cleanup does, so the parameters held are the sharded ones that carry the gradients."""
    from torch.distributed.fsdp import FSDPModule

    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    kept = [(p, p.grad) for part in parts for p in part.parameters() if p.grad is not None]
    try:
        yield
    finally:
        for parameter, grad in kept:
            if parameter.grad is None:
                parameter.grad = grad
            elif parameter.grad is not grad:
                parameter.grad += grad


class Pipeline:
    """The stages of a model this rank runs and the schedule that runs them; `step` is what `training_step` calls.

    Without pipeline parallelism (`schedule` None) it is the model's forward and `loss_fn`, gradients left to
    Lightning's backward."""

    def __init__(
        self,
        model: Module,
        loss_fn: LossFn,
        parts: list[Module] | None = None,
        build: Callable[[list[Module], LossFn | None], Any] | None = None,
        report: Callable[[Tensor | None], Tensor] | None = None,
        share: Callable[[Any], Any] | None = None,
        loss_scale: Callable[[], float] = lambda: 1.0,
        on_backward: Callable[[], None] = lambda: None,
        microbatches: int = 1,
        tied_names: list[list[str]] | None = None,
        schedule: str | None = None,
    ) -> None:
        self.model = model
        #: the names of each weight tied across stages (`tied_across_stages`), in the unsplit model
        self.tied_names = tied_names or []
        #: the schedule's name (`SCHEDULES`), None without stages
        self.schedule = schedule
        self.loss_fn = loss_fn
        #: the modules this rank's stages run, in stage order: parallelize each of them (TP, FSDP2)
        self.parts = parts if parts is not None else [model]
        self.microbatches = microbatches
        self._build = build
        self._report = report
        self._share = share
        self._loss_scale = loss_scale
        self._on_backward = on_backward
        #: schedules by kind ("train", "eval", "predict") and input shapes (`_schedule_for`)
        self._schedules: dict[tuple[Any, ...], Any] = {}

    @property
    def is_pipelined(self) -> bool:
        return self._build is not None

    def _scale(self) -> float:
        """What each microbatch's loss is multiplied by before its backward: the mean over the microbatches (the
        schedule's own `scale_grads` would divide all gradients, those accumulated from earlier batches too)."""
        return self._loss_scale() / self.microbatches

    def _scaled_loss(self, output: Any, target: Any) -> Tensor:
        return self.loss_fn(output, target) * self._scale()

    def _schedule_for(self, kind: str, inputs: tuple[Any, ...], target: Any = None) -> tuple[Any, bool]:
        """The schedule of `kind` for these inputs' shapes, and whether it is new (built at its first use, after
        `configure_model`: the parts are parallelized and on the device now), once `inputs` are checked to split into
        the microbatches.

        One schedule per kind and shape, because torch's stages allocate their receive buffers for the shapes of
        their first batch (a smaller last batch would be received into the first one's buffers), and re-infer them,
        clearing the FSDP modules' gradients, whenever one schedule switches between `step` and `eval`."""
        assert self._build is not None
        if kind != "train":
            refuse_evaluation(self.schedule)
        for input in inputs:
            if isinstance(input, Tensor) and input.shape[0] % self.microbatches:
                raise ValueError(
                    f"A pipeline step splits the batch into {self.microbatches} microbatches; this batch has "
                    f"{input.shape[0]} samples. Make every per-rank batch, the last one included, a multiple of the "
                    "microbatches (`pipeline_microbatches` of the strategy; `drop_last=True` drops a smaller last "
                    "batch)."
                )
        shapes = tuple((x.shape, x.dtype) if isinstance(x, Tensor) else None for x in (*inputs, target))
        key = (kind, shapes)
        schedule = self._schedules.get(key)
        if schedule is not None:
            return schedule, False
        schedule = self._schedules[key] = self._build(self.parts, None if kind == "predict" else self._scaled_loss)
        return schedule, True

    def _kept_gradients(self, new: bool) -> contextlib.AbstractContextManager:
        """Around a schedule's first use: torch's stage initialization ends by setting `.grad = None` on every FSDP
        module's parameters (`_post_metadata_inference_cleanup`), which would drop the gradients an accumulation
        window has summed so far; they are added back."""
        return _gradients_kept(self.parts) if new else contextlib.nullcontext()

    def _run(self, inputs: tuple[Any, ...], target: Any, train: bool) -> Tensor:
        assert self._report is not None
        schedule, new = self._schedule_for("train" if train else "eval", inputs, target)
        losses: list[Tensor] = []
        with self._kept_gradients(new):
            if train:
                schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
                self._on_backward()
            else:
                schedule.eval(*inputs, target=target, losses=losses)
        mean = torch.stack([loss.detach() for loss in losses]).mean() / self._scale() if losses else None
        return self._report(mean)

    def step(self, *inputs: Any, target: Any) -> Tensor:
        """One training batch: with stages, the schedule's forward and backward of all microbatches (the strategy
        skips Lightning's backward for it) and the batch's mean loss, detached, on every rank; without, the loss of
        the model's forward, for Lightning's backward."""
        if not self.is_pipelined:
            return self.loss_fn(self.model(*inputs), target)
        return self._run(inputs, target, train=True)

    def eval(self, *inputs: Any, target: Any) -> Tensor:
        """The batch's mean loss without gradients (validation, test): the forward-only schedule with stages."""
        if not self.is_pipelined:
            return self.loss_fn(self.model(*inputs), target)
        with torch.no_grad():
            return self._run(inputs, target, train=False)

    def predict(self, *inputs: Any) -> Any:
        """The model's output for the batch (`predict_step`): with stages, the forward-only schedule's output of
        the last stage, handed to every rank (as the host object it is, through the pipeline ranks' group)."""
        if not self.is_pipelined:
            return self.model(*inputs)
        assert self._share is not None
        schedule, new = self._schedule_for("predict", inputs)
        with torch.no_grad(), self._kept_gradients(new):
            return self._share(schedule.eval(*inputs))


def pipeline_split(
    model: Module,
    loss_fn: LossFn,
    strategy: Any,
    layers: str | None = None,
) -> Pipeline:
    """Split `model` into the strategy's pipeline stages (`NeuronModelParallelStrategy(pipeline_parallel_size=...)`,
    Trainer or Fabric) and return the `Pipeline` whose `step` runs a batch; with another strategy, or one stage,
    the model whole.

    Args:
        model: the model to split, in place; its `forward` skips the children and layers it lacks (see above).
        loss_fn: `(output, target) -> loss` of one microbatch (a mean over its samples).
        strategy: `self.trainer.strategy` in a LightningModule, `fabric.strategy` with Fabric.
        layers: the stack of layers (a ModuleList or ModuleDict), by dotted path (`"model.layers"` in a Hugging Face
            causal LM); None: the model's only such child.
    """
    split = getattr(strategy, "_pipeline_for", None)
    if split is None or getattr(strategy, "pipeline_parallel_size", 1) == 1:
        return Pipeline(model, loss_fn)
    return split(model, loss_fn, layers)


def split_for_rank(
    model: Module, schedule: str, rank: int, ranks: int, stages_per_rank: int, layers: str | None
) -> tuple[list[int], list[Module]]:
    """This pipeline rank's stage indices and the modules that run them: `model` pruned (in place) to what the
    rank's stages hold, and for several stages one view of it per stage."""
    stages = stages_of_rank(schedule, rank, ranks, stages_per_rank)
    total = ranks * (1 if schedule in SINGLE_STAGE_SCHEDULES else stages_per_rank)
    contents = stage_contents(model, total, layers)
    stack_path = _layers_name(model, layers)
    _keep(model, stack_path, {name for stage in stages for name in contents[stage]})
    if len(stages) == 1:
        return stages, [model]
    return stages, [_part(model, stack_path, set(contents[stage])) for stage in stages]


def check_schedule(schedule: str, stages_per_rank: int, ranks: int, microbatches: int | None) -> None:
    """Refuse a schedule lightning_trn does not run, a stage count it cannot have, or a microbatch count its torch
    schedule refuses later (when the model is split, or in the middle of an estimate), with the choices."""
    if schedule not in SCHEDULES:
        raise ValueError(
            f"pipeline_schedule={schedule!r} is not one lightning_trn runs: choose one of {', '.join(SCHEDULES)} "
            "(GPipe and 1F1B run one stage per rank, Interleaved1F1B `pipeline_stages_per_rank` stages, "
            "ZBVZeroBubble two stages per rank in a V)."
        )
    if schedule in V_SCHEDULES and stages_per_rank != 2:
        raise ValueError(f"pipeline_schedule={schedule!r} runs exactly 2 stages per rank (a V).")
    if schedule not in SINGLE_STAGE_SCHEDULES and stages_per_rank < 2:
        raise ValueError(f"pipeline_schedule={schedule!r} interleaves stages: pipeline_stages_per_rank must be >= 2.")
    if microbatches is None:
        return  # the number of stages: every schedule takes it
    if microbatches < 1:
        raise ValueError(f"pipeline_microbatches={microbatches!r}: give a positive number of microbatches.")
    if schedule in SINGLE_STAGE_SCHEDULES and microbatches < ranks:
        # torch 2.9 refuses it for both, later versions for 1F1B; with fewer, a stage idles through the whole step
        raise ValueError(
            f"pipeline_microbatches={microbatches} with {ranks} pipeline stages: {schedule} needs at least as many "
            f"microbatches as stages. Use pipeline_microbatches >= {ranks}."
        )
    rounds = max(1, microbatches // ranks)
    if schedule not in SINGLE_STAGE_SCHEDULES and microbatches % rounds:
        raise ValueError(
            f"pipeline_microbatches={microbatches} with {ranks} pipeline ranks: {schedule} runs them in"
            f" max(1, microbatches // ranks) = {rounds} rounds of equal size, which {microbatches} microbatches do not"
            f" fill. Use a multiple of {ranks} (e.g. {rounds * ranks}) or at most {ranks}."
        )


def build_schedule(
    schedule: str,
    parts: Sequence[Module],
    stages: Sequence[int],
    num_stages: int,
    device: torch.device,
    group: dist.ProcessGroup,
    microbatches: int,
    loss_fn: LossFn | None,
) -> Any:
    """`torch.distributed.pipelining`'s stages for `parts` and the schedule over them."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    for part in parts:
        # TorchTitan's choice under pipeline parallelism: a stage's FSDP units keep their parameters gathered from
        # the forward to the backward, else every microbatch gathers them twice; torch's split backward
        # (ZBVZeroBubble) needs them gathered too, since its weight pass reads the parameters the forward used
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_reshard_after_forward(False, recurse=False)
    pipeline_stages = [
        PipelineStage(part, stage, num_stages, device, group=group) for part, stage in zip(parts, stages, strict=True)
    ]
    schedule_class = get_schedule_class(schedule)
    stages_argument = pipeline_stages[0] if schedule in SINGLE_STAGE_SCHEDULES else pipeline_stages
    # `loss_fn` takes the mean over the microbatches itself (`Pipeline._scale`)
    return schedule_class(stages_argument, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


class Pipelining:
    """A strategy's pipeline parallelism (Trainer and Fabric alike): its settings, the pipeline groups it creates
    once the device mesh exists, and the `Pipeline` it splits a model into.

    Args:
        size: pipeline stages' ranks (`pipeline_parallel_size`); 1: none.
        schedule: one of `SCHEDULES`.
        microbatches: microbatches per batch; None: the number of stages (the fewest that fill the pipeline).
        stages_per_rank: stages on each rank for the interleaved schedules (2 for ZBVZeroBubble).
        transport: how stages exchange tensors (`lightning_trn.core.parallel.stage_transport.TRANSPORTS`); None: the
            backend's own send/recv where `point_to_point` says it has them, else broadcasts.
    """

    def __init__(
        self,
        size: int,
        schedule: str,
        microbatches: int | None,
        stages_per_rank: int,
        transport: str | None,
        point_to_point: bool = False,
    ) -> None:
        from lightning_trn.core.parallel.stage_transport import TRANSPORTS

        transport = transport or ("send_recv" if point_to_point else "broadcast")
        self.size = size
        self.schedule = schedule
        self.stages_per_rank = 1 if schedule in SINGLE_STAGE_SCHEDULES else stages_per_rank
        if size > 1:
            check_schedule(schedule, self.stages_per_rank, size, microbatches)
            if transport not in TRANSPORTS:
                raise ValueError(f"stage_transport={transport!r}: choose one of {', '.join(TRANSPORTS)}.")
        self.num_stages = size * self.stages_per_rank
        self.microbatches = microbatches or self.num_stages
        self.transport = transport
        self._mesh: Any = None
        self._group: dist.ProcessGroup | None = None
        #: the ranks that hold the same stages as this one (all but the pipeline dimension), None if it alone does
        self.stage_group: dist.ProcessGroup | None = None
        self._device: torch.device | None = None
        #: the pipeline groups' members by pipeline rank (global ranks), once `setup` made them
        self._columns: list[list[int]] = []
        #: the weights tied across stages that this rank holds a copy of: the group of the ranks holding the other
        #: copies (None: only this rank's stages hold it), the names this rank's stages give it, and whether this
        #: rank's copy counts in the gradient norm
        self._ties: list[tuple[dist.ProcessGroup | None, list[str], bool]] = []
        self._model: Module | None = None
        self._tied_names: list[list[str]] = []
        self._ran_backward = False
        #: this rank's stage indices and the modules that run them, once `split` made them
        self._stage_parts: list[tuple[int, Module]] = []

    def setup(self, mesh: Any, device: torch.device, backend: str | None) -> None:
        """Create the pipeline groups of the mesh (every process all of them, in one order) and keep this rank's."""
        from lightning_trn.core.parallel.stage_transport import pipeline_groups

        if self.size == 1:
            return
        ranks = mesh.mesh  # rank of each coordinate; the pipeline dimension first
        groups = self._columns = ranks.reshape(self.size, -1).t().tolist()
        looped = self.schedule not in (*SINGLE_STAGE_SCHEDULES, *V_SCHEDULES)  # only they send last -> first
        created = pipeline_groups(groups, self.transport, backend, wrap=looped)
        rank = dist.get_rank()
        self._group = next(group for members, group in zip(groups, created, strict=True) if rank in members)
        for members in ranks.reshape(self.size, -1).tolist():
            if len(members) > 1:
                group = dist.new_group(members, backend=backend)
                self.stage_group = group if rank in members else self.stage_group
        self._mesh = mesh
        self._device = device

    @property
    def stage_peers(self) -> tuple[dist.ProcessGroup | None, bool]:
        """Where tensors every holder of a stage has alike are made equal (`broadcast_replicated`'s `group` and
        `alone`): the group of the ranks holding this rank's stages, and whether this rank holds them alone."""
        return self.stage_group, self.size > 1 and self.stage_group is None

    @property
    def norm_group(self) -> Any:
        """The group over which gradient norms are combined (the stages' ranks), None without stages."""
        return self._mesh["pipeline_parallel"].get_group() if self._mesh is not None else None

    def complete_param_groups(self, state: dict[str, Any], module: Module) -> dict[str, Any]:
        """`state`, an optimizer state of `get_optimizer_state_dict` (parameters by name in `module`), with its
        `param_groups` listing every stage's parameters, in the unsplit model's order: a checkpoint keeps one rank's
        groups, and one consolidated into a file (`load_consolidated`, the recipes' `export`) needs the position of
        every parameter in its group. Without stages, or before the split, `state` as it is."""
        if self.size == 1 or not self._stage_parts:
            return state
        names = {id(parameter): _unwrapped_name(name) for name, parameter in module.named_parameters()}
        held = [(stage, names[id(p)]) for stage, part in self._stage_parts for p in part.parameters() if id(p) in names]
        groups = [list(group["params"]) for group in state["param_groups"]]
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, (held, groups), group=self._mesh["pipeline_parallel"].get_group())
        # a stage's parameters come in its module's order, and stages follow the model
        order = [name for _, name in sorted((pair for pairs, _ in gathered for pair in pairs), key=lambda p: p[0])]
        for index, group in enumerate(state["param_groups"]):
            listed = {name for _, rank_groups in gathered for name in rank_groups[index]}
            group["params"] = [name for name in order if name in listed]
        return state

    def uncounted_in_norm(self) -> list[Tensor]:
        """The tied copies whose gradient is counted elsewhere in the norm (the first stage holding the weight counts
        it): `lightning_trn.core.parallel.gradients.NormScope`."""
        if not self._ties:
            return []
        parameters = self._parameters()
        uncounted = []
        for _, names, counted in self._ties:
            copies = _distinct(parameters[name] for name in names)
            uncounted += copies[1:] if counted else copies
        return uncounted

    def _parameters(self) -> dict[str, Tensor]:
        """This rank's parameters by their name in the model, whatever wraps or shards them now."""
        assert self._model is not None
        return {_unwrapped_name(name): p for name, p in self._model.named_parameters(remove_duplicate=False)}

    def reduce_tied_gradients(self) -> None:
        """Sum the gradients of each weight tied across stages over its copies, so that every copy takes the unsplit
        weight's gradient and update (the copies' values start equal: the split model's). The copies are those the
        ranks holding the weight's stages have, and on one rank the copies FSDP2 makes when it shards each stage's
        module on its own. Called once the step's gradients are complete, before clipping (the strategies'
        `reduce_gradients`). The copies are sharded alike on every stage (the same mesh and placements), so their
        local shards are summed."""
        if not self._ties:
            return
        parameters = self._parameters()
        for group, names, _ in self._ties:
            copies = _distinct(parameters[name] for name in names)
            for parameter in copies:
                if parameter.grad is None:  # a copy that took no gradient still joins the sum
                    parameter.grad = torch.zeros_like(parameter)
            grads = [_local(parameter.grad) for parameter in copies if parameter.grad is not None]
            for other in grads[1:]:
                grads[0] += other
            if group is not None:
                dist.all_reduce(grads[0], group=group)
            for other in grads[1:]:
                other.copy_(grads[0])

    def _tie(self, model: Module, layers: str | None, pipeline_rank: int) -> None:
        """Find the weights tied across this split's stages (`tied_across_stages`) and create, on every process in
        the same order, the groups of the ranks that hold their copies (per pipeline group)."""
        contents = stage_contents(model, self.num_stages, layers)
        stages = stages_of_rank(self.schedule, pipeline_rank, self.size, self.stages_per_rank)
        rank = dist.get_rank()
        groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._ties = []
        ties = tied_across_stages(model, contents)
        self._tied_names = [list(holders.values()) for holders in ties]
        for holders in ties:
            pipeline_ranks = sorted({stage_rank(self.schedule, s, self.size, self.stages_per_rank) for s in holders})
            held = [holders[stage] for stage in sorted(holders) if stage in stages]
            if len(pipeline_ranks) == 1:  # one rank's stages (a V's first and last): one parameter, until FSDP2
                if len(held) > 1:  # shards each stage's module on its own, making a copy per stage
                    self._ties.append((None, held, True))
                continue
            key = tuple(pipeline_ranks)
            if key not in groups:
                groups[key] = None
                for column in self._columns:
                    group = dist.new_group([column[r] for r in pipeline_ranks])
                    groups[key] = group if rank in (column[r] for r in pipeline_ranks) else groups[key]
            group = groups[key]
            if held and group is not None:
                counted = stage_rank(self.schedule, min(holders), self.size, self.stages_per_rank) == pipeline_rank
                self._ties.append((group, held, counted))

    def check_loader(self, loader: Any) -> None:
        """Refuse, before the first batch, a training loader whose batches do not all divide into the microbatches
        (a smaller last batch included): found at its step, it would stop a run that has trained already. Loaders
        without a length or batch size (iterable datasets) are left to the step's own check."""
        batch_size, sampler = getattr(loader, "batch_size", None), getattr(loader, "sampler", None)
        if self.size == 1 or not isinstance(batch_size, int) or not isinstance(sampler, Sized):
            return
        last = len(sampler) % batch_size if not getattr(loader, "drop_last", False) else 0
        sizes = sorted(size for size in {batch_size, last} if size and size % self.microbatches)
        if sizes:
            raise ValueError(
                f"A pipeline step splits each batch into {self.microbatches} microbatches; this rank's training "
                f"loader gives batches of {' and '.join(map(str, sizes))} samples (batch_size={batch_size}, "
                f"{len(sampler)} samples per rank{', the last batch smaller' if last else ''}). Make every per-rank "
                "batch a multiple of the microbatches (`pipeline_microbatches` of the strategy), or drop the "
                "smaller last batch (`DataLoader(..., drop_last=True)`)."
            )

    def take_backward(self) -> bool:
        """Whether the last `Pipeline.step` ran the backward of the batch (once: the flag is cleared)."""
        ran, self._ran_backward = self._ran_backward, False
        return ran

    def _mark_backward(self) -> None:
        self._ran_backward = True

    def split(
        self, model: Module, loss_fn: LossFn, layers: str | None, loss_scale: Callable[[], float] = lambda: 1.0
    ) -> Pipeline:
        """`model` split for this rank (`split_for_rank`) and the `Pipeline` that runs its stages."""
        if self._mesh is None:
            raise RuntimeError(
                "pipeline_split runs once the processes and the device mesh exist: call it in `configure_model` "
                "(Trainer) or in the `parallelize_fn` (Fabric)."
            )
        mesh, device = self._mesh, self._device
        assert device is not None and self._group is not None
        pipeline_rank = mesh["pipeline_parallel"].get_local_rank()
        self._model = model
        self._tie(model, layers, pipeline_rank)
        stages, parts = split_for_rank(model, self.schedule, pipeline_rank, self.size, self.stages_per_rank, layers)
        self._stage_parts = list(zip(stages, parts, strict=True))
        last = stage_rank(self.schedule, self.num_stages - 1, self.size, self.stages_per_rank)
        group, report_group = self._group, mesh["pipeline_parallel"].get_group()

        def build(parts: list[Module], scaled_loss: LossFn | None) -> Any:
            return build_schedule(
                self.schedule, parts, stages, self.num_stages, device, group, self.microbatches, scaled_loss
            )

        def report(loss: Tensor | None) -> Tensor:
            """The last stage's loss on every stage's rank."""
            value = loss.float() if loss is not None else torch.zeros((), device=device)
            dist.broadcast(value, group=report_group, group_src=last)
            return value

        def share(output: Any) -> Any:
            """The last stage's output on every stage's rank, on this rank's device (whole: a DTensor, the logits
            split over the vocabulary under tensor parallel, is gathered first)."""
            if hasattr(output, "full_tensor"):
                output = output.full_tensor()
            objects = [output.cpu() if isinstance(output, Tensor) else output]
            dist.broadcast_object_list(objects, group=report_group, group_src=last, device=device)
            return objects[0].to(device) if isinstance(objects[0], Tensor) else objects[0]

        return Pipeline(
            model,
            loss_fn,
            parts,
            build=build,
            report=report,
            share=share,
            loss_scale=loss_scale,
            on_backward=self._mark_backward,
            microbatches=self.microbatches,
            tied_names=self._tied_names,
            schedule=self.schedule,
        )
