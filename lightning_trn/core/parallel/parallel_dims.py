"""`ParallelDims`: the device mesh's dimensions and their sizes, one validated object (TorchTitan's `ParallelDims`)
that both model-parallel strategies hold and the LLM recipe reads, so that a new dimension is one field here.

The dimensions go outermost first, TorchTitan's order: pipeline stages and HSDP replicas across nodes, tensor parallel
inside a node, context parallel (each sequence split, `context_parallel.py`) just outside it. "pipeline_parallel",
"replicate" and "context_parallel" are in the mesh only when above 1, so a module written for Lightning's 2-D mesh
("data_parallel", "tensor_parallel") runs unchanged. With context parallel, FSDP2 shards over data x context
together (`fsdp_mesh`), as TorchTitan's "dp_shard_cp".
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal

#: the device mesh's dimensions, outermost first
MESH_DIMENSIONS = ("pipeline_parallel", "replicate", "data_parallel", "context_parallel", "tensor_parallel")
#: the flattened data x context dimension FSDP2 shards over under context parallelism (`fsdp_mesh`)
DATA_CONTEXT = "data_context_parallel"
#: the dimensions that may be "auto" (Lightning's `ModelParallelStrategy` arguments)
_AUTO = ("data_parallel", "tensor_parallel")
#: each dimension's argument in the strategies and the recipe
ARGUMENTS = {
    "pipeline_parallel": "pipeline_parallel_size",
    "replicate": "replicate_size",
    "data_parallel": "data_parallel_size",
    "context_parallel": "context_parallel_size",
    "tensor_parallel": "tensor_parallel_size",
}

Size = int | Literal["auto"]


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of `MESH_DIMENSIONS` as given (data and tensor parallel may be "auto"), checked against the run's
    processes once they are known (`check`), resolved (`sizes`), and the mesh built from them (`build_mesh`)."""

    pipeline_parallel: int = 1
    replicate: int = 1
    data_parallel: Size = "auto"
    tensor_parallel: Size = "auto"
    context_parallel: int = 1

    @property
    def outer(self) -> int:
        """The dimensions beyond Lightning's two (pipeline x replicate x context); 1: Lightning's own 2-D mesh
        serves."""
        return self.pipeline_parallel * self.replicate * self.context_parallel

    def sizes(self, num_nodes: int, num_processes: int) -> dict[str, int]:
        """The size of each dimension, "auto" resolved: as Lightning's `ModelParallelStrategy` without pipeline
        stages or replicas (tensor parallel = devices of a node, data parallel = nodes); with them, tensor parallel 1
        and data parallel what the other sizes leave of the world."""
        world = num_nodes * num_processes
        lightnings = self.outer == 1  # Lightning's own 2-D mesh: its meaning of "auto"
        tensor = self.tensor_parallel if self.tensor_parallel != "auto" else (num_processes if lightnings else 1)
        if self.data_parallel != "auto":
            data = self.data_parallel
        else:
            data = num_nodes if lightnings else max(world // (self.outer * tensor), 1)
        sizes = (self.pipeline_parallel, self.replicate, data, self.context_parallel, tensor)
        return dict(zip(MESH_DIMENSIONS, sizes, strict=True))

    def check(self, owner: str, num_nodes: int, num_processes: int) -> dict[str, int]:
        """The resolved sizes, once the devices and nodes are known (at `Trainer(...)` / `Fabric(...)`), after
        checking that each is a positive number and that the mesh covers the run's processes exactly, as
        TorchTitan's `ParallelDims` checks it. `owner` names the strategy in the message."""
        given = {ARGUMENTS[name]: getattr(self, name) for name in MESH_DIMENSIONS}
        for name, size in given.items():
            if size != "auto" and (not isinstance(size, int) or size < 1):
                raise ValueError(
                    f"{owner}({name}={size!r}): each mesh size is a positive whole number"
                    + (' or "auto".' if name in (ARGUMENTS[d] for d in _AUTO) else ".")
                )
        if self.context_parallel > 1 and self.pipeline_parallel > 1:
            raise ValueError(
                f"{owner}(context_parallel_size={self.context_parallel}, pipeline_parallel_size="
                f"{self.pipeline_parallel}): context parallelism does not run with pipeline stages yet (the stages "
                "would hand over split sequences, which no test here has proven equal to one device). Use the "
                "context ranks for FSDP2 and tensor parallel instead (context_parallel_size with data_parallel_size "
                "and tensor_parallel_size), or pipeline stages without context parallelism."
            )
        sizes = self.sizes(num_nodes, num_processes)
        processes = num_nodes * num_processes
        product = math.prod(sizes.values())
        if product != processes:
            shown = [ARGUMENTS[d] for d in _AUTO]
            arguments = ", ".join(f"{name}={size!r}" for name, size in given.items() if size != 1 or name in shown)
            resolved = " x ".join(f"{name} {size}" for name, size in sizes.items() if size != 1) or "1"
            raise ValueError(
                f"{owner}({arguments}) needs {product} processes, the run has {processes} "
                f"(devices={num_processes} x num_nodes={num_nodes}; the mesh: {resolved}). Choose sizes whose "
                "product is devices x num_nodes; tensor parallelism is fastest within a node, e.g. "
                "tensor_parallel_size=devices and data_parallel_size=num_nodes (the defaults, 'auto'); pipeline "
                "stages and HSDP replicas go across nodes (pipeline_parallel_size or replicate_size = num_nodes)."
            )
        return sizes

    @staticmethod
    def build_mesh(sizes: dict[str, int], device_type: str) -> Any:
        """The device mesh of `sizes` (`ParallelDims.sizes`): "data_parallel" and "tensor_parallel" always, the
        others where above 1; with "context_parallel", also data x context flattened (`DATA_CONTEXT`)."""
        from torch.distributed.device_mesh import init_device_mesh

        dimensions = {name: size for name, size in sizes.items() if size > 1 or name in _AUTO}
        mesh = init_device_mesh(device_type, tuple(dimensions.values()), mesh_dim_names=tuple(dimensions))
        if "context_parallel" in dimensions:
            mesh["data_parallel", "context_parallel"]._flatten(DATA_CONTEXT)
        return mesh

    @staticmethod
    def fsdp_mesh(mesh: Any) -> Any:
        """The mesh FSDP2 shards over: "data_parallel", or with context parallel data x context flattened (each
        context rank computes gradients of its part of the sequences, which FSDP2's reduce-scatter sums), with
        "replicate" before it where there are HSDP replicas (a 2-D mesh makes `fully_shard` HSDP)."""
        names = mesh.mesh_dim_names or ()
        if "context_parallel" not in names:
            return mesh["replicate", "data_parallel"] if "replicate" in names else mesh["data_parallel"]
        with warnings.catch_warnings():
            # torch 2.13 still slices a flattened dimension from the root mesh (TorchTitan's `dp_shard_cp` way) and
            # warns that a later version will not; its replacement needs the flattened mesh kept beside the root
            warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
            return mesh["replicate", DATA_CONTEXT] if "replicate" in names else mesh[DATA_CONTEXT]

    @staticmethod
    def sampler_kwargs(mesh: Any) -> dict[str, int]:
        """A `DistributedSampler`'s `num_replicas` and `rank`: the replicate and data-parallel dimensions together
        (HSDP's replicas read different data too; a pipeline's stages and a tensor-parallel group read the same)."""
        names = mesh.mesh_dim_names
        rank, size = 0, 1
        for name in ("replicate", "data_parallel"):
            if name in names:
                rank, size = rank * mesh[name].size() + mesh[name].get_local_rank(), size * mesh[name].size()
        return {"num_replicas": size, "rank": rank}
