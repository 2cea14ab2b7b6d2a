"""A device check, run by hand on a GPU machine (no Neuron, no stand-in, no torch_xla): ZeRO-1 checkpoints written by
`tests/scripts/zero1_train.py` on 2 processes (a full file, and a sharded directory consolidated with
`python -m lightning_trn.consolidate`) resume with `Trainer(accelerator="gpu")` exactly as the GPU run's own
checkpoint does.

    python tests/scripts/gpu_resume_check.py <full checkpoint file> <consolidated checkpoint file> ...

For each file: the Adam moments the GPU Trainer restores equal the file's, and 6 more steps end where Lightning's
own resume of a GPU checkpoint taken at the same step ends. Exits 1 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).parent))
from zero1_train import ACCUMULATE, CLIP, SEED, STEPS, Net, dataset

TOLERANCE = 1e-5


class GpuNet(Net):
    """The job's module without its Neuron metrics hook, recording the optimizer state the run starts from."""

    restored: dict | None = None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        pass

    def on_train_start(self) -> None:
        state = self.trainer.optimizers[0].state_dict()["state"]
        self.restored = {i: {k: v.detach().cpu().clone() for k, v in s.items()} for i, s in state.items()}


def fit(max_steps: int, ckpt_path: str | None = None, save: str | None = None) -> tuple[dict, dict | None]:
    pl.seed_everything(SEED)
    torch.manual_seed(SEED)
    model = GpuNet()
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)  # zero1_train's 1-process order
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(save)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, model.restored


def gap(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main() -> None:
    torch.set_float32_matmul_precision("highest")
    print("torch", torch.__version__, "lightning", pl.__version__, torch.cuda.get_device_name(0))
    fit(STEPS, save="/tmp/gpu_step6.ckpt")
    lightning_resumed, _ = fit(2 * STEPS, ckpt_path="/tmp/gpu_step6.ckpt")
    ok = True
    for name in sys.argv[1:]:
        saved = torch.load(name, weights_only=True)["optimizer_states"][0]["state"]  # CPU tensors only
        weights, restored = fit(2 * STEPS, ckpt_path=name)
        assert restored is not None
        moments = max(
            (restored[i][k] - saved[i][k]).abs().max().item() for i in saved for k in ("exp_avg", "exp_avg_sq")
        )
        to_lightning = gap(weights, lightning_resumed)
        print(
            f"{name}: restored Adam moments differ from the file's by {moments:.2e}; after {STEPS} more steps the "
            f"weights differ from Lightning's own GPU resume by {to_lightning:.2e}"
        )
        ok &= moments == 0 and to_lightning < TOLERANCE
    print("GPU RESUME CHECK", "PASSED" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
