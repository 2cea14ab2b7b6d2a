"""Worker script for tests/checkpoint/test_cross_backend.py: train `RegressionModel` to `--epochs`, optionally resuming
from `--resume`, on `--accelerator` (neuron: whichever backend this interpreter has; cpu: stock Lightning), then write
`--save` (a Lightning checkpoint) and print `RESULT <json>` with the backend, the global step and the weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: models.py

from models import RegressionModel, regression_loader

import lightning_trn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", choices=["neuron", "cpu"], required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--save", type=Path, required=True)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0, help="initial weights (a resumed run must overwrite them)")
    args = parser.parse_args()
    pl.seed_everything(args.seed)
    model = RegressionModel()
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, regression_loader(n=64, batch_size=16, shuffle=False), ckpt_path=args.resume)
    trainer.save_checkpoint(args.save)
    backend = lightning_trn.runtime.get_runtime().name if args.accelerator == "neuron" else "cpu"
    weights = {name: value.cpu().flatten().tolist() for name, value in model.state_dict().items()}
    print("RESULT " + json.dumps({"backend": backend, "global_step": trainer.global_step, "weights": weights}))


if __name__ == "__main__":
    main()
