"""Per-process Neuron runtime environment for data-parallel training, computed from the job's ranks.

torch_xla maps torchrun's `RANK`/`LOCAL_RANK`/`WORLD_SIZE`/`LOCAL_WORLD_SIZE` to the Neuron PJRT variables at import
(`torch_xla._internal.neuron.configure_pjrt_environment`), but only when torchrun launched the process. Self-launched
(`python train.py`) and SLURM (`srun`) workers get the same mapping from here, from Lightning's cluster environment.
The values mirror torch_xla's, and the function is idempotent, so applying it after torch_xla's mapping changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning_trn.runtime.discovery import parse_core_range

#: Port torch_xla uses for the Neuron runtime's root communicator (`NEURON_RT_ROOT_COMM_ID=<MASTER_ADDR>:62182`).
NEURON_RT_ROOT_COMM_PORT = 62182


def _root_comm_id(main_address: str) -> str:
    if len(main_address.split(":")) >= 3 and not main_address.startswith("["):  # IPv6 needs brackets before the port
        main_address = f"[{main_address}]"
    return f"{main_address}:{NEURON_RT_ROOT_COMM_PORT}"


def _visible_core(env: Mapping[str, str], local_rank: int, local_world_size: int) -> str:
    """The one NeuronCore this process drives: its local rank, or its slot in a user-given NEURON_RT_VISIBLE_CORES."""
    spec = env.get("NEURON_RT_VISIBLE_CORES", "").strip()
    if not spec:
        return str(local_rank)
    cores = parse_core_range(spec)
    if len(cores) == local_world_size:
        return str(cores[local_rank])
    if len(cores) == 1:  # already narrowed to this process's core (by torch_xla under torchrun, or by the launcher)
        return str(cores[0])
    raise ValueError(
        f"NEURON_RT_VISIBLE_CORES={spec!r} lists {len(cores)} NeuronCores but this node runs {local_world_size} "
        "processes (one per core). Make `devices` (torchrun's --nproc_per_node) equal to the number of visible "
        "cores, or unset NEURON_RT_VISIBLE_CORES."
    )


def neuron_process_env(
    env: Mapping[str, str],
    *,
    global_rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    main_address: str,
) -> dict[str, str]:
    """Environment variables this worker needs before the Neuron PJRT client starts; values already in `env` win.

    `NEURON_RT_VISIBLE_CORES` is always narrowed to one core (one process per NeuronCore).
    """
    updates = {
        "NEURON_RT_ROOT_COMM_ID": env.get("NEURON_RT_ROOT_COMM_ID") or _root_comm_id(main_address),
        "NEURON_PJRT_PROCESS_INDEX": env.get("NEURON_PJRT_PROCESS_INDEX") or str(global_rank),
        "PJRT_LOCAL_PROCESS_RANK": env.get("PJRT_LOCAL_PROCESS_RANK") or str(local_rank),
        "NEURON_RT_VISIBLE_CORES": _visible_core(env, local_rank, local_world_size),
    }
    if "NEURON_PJRT_PROCESSES_NUM_DEVICES" not in env and "NEURON_PJRT_WORLD_SIZE" not in env:
        updates["NEURON_PJRT_WORLD_SIZE"] = str(world_size)
        updates["PJRT_LOCAL_PROCESS_COUNT"] = env.get("PJRT_LOCAL_PROCESS_COUNT") or str(local_world_size)
    return updates
