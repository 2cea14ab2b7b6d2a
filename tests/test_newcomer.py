"""A newcomer's walk-through, on the running backend (both suites): what an engineer who knows Lightning and Hugging
Face does first with the plugin, from the docs alone, and the mistakes they make on the way, each cheap and in this
process. The two training runs (a recipe fine-tune, a module of one's own) run on the stand-in only: what they add
(logger, export, consolidation) is backend-independent, and on XLA:CPU their compiles take most of a minute.

The five tasks and where each is checked:

- fine-tune a `save_pretrained` folder with the LLM recipe (full): tests/recipes/test_recipe_llm_pretrained.py (one step
  equals plain transformers; export, generate, load again); here with `logger=tensorboard`, exported from a sharded
  checkpoint directory;
- LoRA: tests/recipes/test_recipe_llm_lora.py (only the adapters train; resume; merged export);
- FSDP on 2 ranks: tests/recipes/test_recipe_llm_lora_sharded.py, test_recipe_llm_pretrained_sharded.py and
  test_recipe_llm_strategies_native.py (which also finds no sampler warning in the 2-rank run's output);
- a LightningModule of one's own with `load_pretrained`, exported to a Hugging Face folder: here, the blocks of
  docs/getting-started.md run as written, and its LightningCLI example;
- estimate one's own module: tests/estimate/test_estimate.py.

The mistakes are docs/troubleshooting.md's "Fine-tuning mistakes" table: each row made here, its documented message
checked.
"""

from __future__ import annotations

import re
import runpy
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from safetensors.torch import load_file

import lightning_trn
from lightning_trn import consolidate
from lightning_trn.core.checkpoint.pretrained import check_local_folder
from lightning_trn.recipes import cli, common, llm
from lightning_trn.recipes.tensor_datamodule import evaluation_multiple
from lightning_trn.runtime import get_runtime
from tests.recipes.test_recipe_llm_lora import LORA
from tests.recipes.test_recipe_llm_pretrained import STEP, Folder, save_folder

pytestmark = pytest.mark.both

DOCS = Path(__file__).resolve().parents[1] / "docs"
#: the table of docs/troubleshooting.md this module checks: id -> the message's fragments (split at `…`)
MISTAKES_HEADING = "## Fine-tuning mistakes"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return save_folder(tmp_path_factory.mktemp("pretrained"))


def documented_mistakes() -> dict[str, list[str]]:
    """id -> the message fragments of each row of troubleshooting.md's fine-tuning table (3 columns)."""
    text = (DOCS / "troubleshooting.md").read_text().split(MISTAKES_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"[a-z][a-z0-9-]*", cells[0]) and cells[0] != "id":
            rows[cells[0]] = [part.strip().strip("`") for part in cells[2].split("…")]
    return rows


def _no_hub(*args: object, **kwargs: object) -> None:
    raise AssertionError("transformers was asked to load a missing folder (it would try the Hugging Face Hub)")


@pytest.fixture
def mistake(folder: Folder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], str]:
    """Make the mistake of a row; the error's text."""
    import transformers

    def lora_target_typo() -> None:
        overrides = [f"model.pretrained={folder.path}", f"data.source={folder.rows}", f"out_dir={tmp_path}", *LORA]
        overrides.append("model.lora.target=[q_prj,v_proj]")
        llm.RECIPE.build_model(cli.load_config(llm.RECIPE, overrides))

    def pretrained_folder_missing() -> None:
        # the data module reads the tokenizer first, the model its config: neither may reach transformers' loading
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", _no_hub)
        monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", _no_hub)
        monkeypatch.chdir(tmp_path)
        (tmp_path / "models").mkdir()
        overrides = ["model.pretrained=models/tiny-lama", f"data.source={folder.rows}", f"out_dir={tmp_path}"]
        cfg = cli.load_config(llm.RECIPE, overrides)
        with pytest.raises(FileNotFoundError, match="does not exist"):
            llm.RECIPE.build_model(cfg)
        llm.RECIPE.build_data(cfg)

    def export_not_a_checkpoint() -> None:
        (tmp_path / "ckpt").mkdir()
        common.export(llm.RECIPE, str(tmp_path / "ckpt"), str(tmp_path / "out"))

    actions: dict[str, Callable[[], object]] = {
        "lora-target-typo": lora_target_typo,
        "pretrained-folder-missing": pretrained_folder_missing,
        "precision-typo": lambda: Trainer(accelerator="neuron", precision="bf16-mixd", logger=False),
        "too-many-devices": lambda: Trainer(accelerator="neuron", devices=100_000, logger=False),
        "export-not-a-checkpoint": export_not_a_checkpoint,
    }

    def make(row: str) -> str:
        with pytest.raises(Exception) as error:  # the rows' errors are of several types
            actions[row]()
        return str(error.value)

    return make


@pytest.mark.parametrize(("row", "fragments"), sorted(documented_mistakes().items()))
def test_each_mistake_says_what_the_table_says(row: str, fragments: list[str], mistake: Callable[[str], str]) -> None:
    message = mistake(row)
    for fragment in fragments:
        assert fragment in message, f"{row}: {fragment!r} not in {message!r}"


def test_the_mistakes_table_has_every_row() -> None:
    assert sorted(documented_mistakes()) == [
        "export-not-a-checkpoint",
        "lora-target-typo",
        "precision-typo",
        "pretrained-folder-missing",
        "too-many-devices",
    ]


def test_messages_name_the_backends_own_remedies(mistake: Callable[[str], str]) -> None:
    """The device-count error names what widens the count where the run is (the stand-in reads no Neuron runtime
    variable), and the precision error lists only what the plugin takes (no fp16, no 64-bit)."""
    devices = mistake("too-many-devices")
    standin = get_runtime().device_type == "neuron"
    assert ("LIGHTNING_TRN_STANDIN_DEVICES" in devices) is standin
    assert ("XLA:CPU" in devices) is not standin
    assert "NEURON_RT_VISIBLE_CORES" not in devices
    assert "transformer-engine" not in mistake("precision-typo") and "64-true" not in mistake("precision-typo")


@pytest.mark.parametrize("value", ["./tiny", "../tiny", "/nonexistent/tiny", "~/nonexistent-tiny", "models/tiny"])
def test_path_like_values_that_do_not_exist_are_refused(
    value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_local_folder(value)


@pytest.mark.parametrize("value", ["meta-llama/Llama-3.1-8B", "gpt2", "models"])
def test_hub_ids_and_existing_folders_pass(value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub id (no such local folder here) goes on to transformers' download; an existing folder is read."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    check_local_folder(value)


def test_every_lora_target_must_match_a_module(folder: Folder) -> None:
    """One misspelled name among matching ones: PEFT alone would give the others adapters and drop it silently."""
    from lightning_trn.recipes.llm import lora

    net = llm.pretrained_model(str(folder.path), "sdpa", meta=True)
    with pytest.raises(ValueError, match=r"'q_prj' \(did you mean 'q_proj'\?\) matches no module") as error:
        lora.add_adapters(net, {"r": 2, "alpha": 4.0, "dropout": 0.0, "target": ["q_prj", "v_proj"]}, meta=True)
    for name in ("down_proj", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj", "up_proj", "v_proj"):
        assert name in str(error.value)
    assert not lora.adapter_parameters(net)  # refused before any adapter was added
    lora.add_adapters(net, {"r": 2, "alpha": 4.0, "dropout": 0.0, "target": ["self_attn.q_proj", "v_proj"]}, meta=True)
    assert len(lora.adapter_parameters(net)) == 2 * 2 * 2  # 2 layers x 2 targets x (A, B)


def _as_distributed_checkpoint(file: Path, directory: Path) -> None:
    """`file`'s checkpoint written as a sharded strategy writes one: its tensors as a torch.distributed.checkpoint
    directory (one process, no process group), Lightning's other entries in `meta.pt`."""
    import torch.distributed.checkpoint as dcp

    checkpoint = torch.load(file, weights_only=True)
    saved = {"state_dict": checkpoint["state_dict"], "optimizer_0": checkpoint["optimizer_states"][0]}
    dcp.save(saved, checkpoint_id=str(directory), no_dist=True)
    rest = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
    torch.save(rest, directory / "meta.pt")


@pytest.mark.native_only  # backend-independent (logger, export); the XLA fine-tune: test_recipe_llm_pretrained.py
def test_fine_tune_logs_to_tensorboard_and_a_sharded_directory_exports(folder: Folder, tmp_path: Path) -> None:
    """`logger=tensorboard` writes TensorBoard's event files where `metrics.csv` would be; `export` of a sharded
    strategy's checkpoint directory consolidates it and writes the folder the one-file checkpoint gives."""
    run = tmp_path / "run"
    overrides = [f"model.pretrained={folder.path}", f"data.source={folder.rows}", f"out_dir={run}", *STEP]
    overrides += ["logger=tensorboard", "trainer.max_steps=1", "trainer.limit_val_batches=1"]
    _, results = cli.main(llm.RECIPE, [*overrides, "trainer.limit_test_batches=1"])
    assert list((run / "logs").glob("events.out.tfevents.*")) and not (run / "logs" / "metrics.csv").exists()
    checkpoint = Path(results["checkpoint"])
    sharded = tmp_path / "sharded.ckpt"
    _as_distributed_checkpoint(checkpoint, sharded)
    cli.main(llm.RECIPE, ["export", f"ckpt={checkpoint}", f"out={tmp_path / 'from_file'}"])
    cli.main(llm.RECIPE, ["export", f"ckpt={sharded}", f"out={tmp_path / 'from_directory'}"])
    from_file = load_file(tmp_path / "from_file" / "model.safetensors")
    from_directory = load_file(tmp_path / "from_directory" / "model.safetensors")
    assert from_file.keys() == from_directory.keys()
    for name, value in from_file.items():
        assert torch.equal(from_directory[name], value), name
    original = load_file(folder.path / "model.safetensors")
    assert not torch.equal(from_file["model.norm.weight"], original["model.norm.weight"])  # trained
    assert not list(tmp_path.glob(".consolidated-*"))  # the scratch file is gone


def test_evaluation_splits_are_whole_batches_on_every_rank(folder: Folder, tmp_path: Path) -> None:
    """Lightning's `DistributedSampler` would repeat rows to even out the ranks: padded to batch x ranks, it repeats
    none (the padding rows count no token)."""
    overrides = [f"model.pretrained={folder.path}", f"data.source={folder.rows}", f"out_dir={tmp_path}", *STEP]
    data = llm.RECIPE.build_data(cli.load_config(llm.RECIPE, [*overrides, "data.batch_size=3"]))

    class TwoRanks:
        distributed_sampler_kwargs = {"num_replicas": 2, "rank": 0}

    assert evaluation_multiple(data, 3) == 3
    data.trainer = TwoRanks()  # type: ignore[assignment]  # what the data module reads of a 2-rank Trainer
    assert evaluation_multiple(data, 3) == 6
    rows = len(data.val_dataloader().dataset)
    assert rows % 6 == 0 and 0 <= rows - len(data.splits["val"]["input_ids"]) < 6


def _blocks(doc: str, heading: str) -> Iterator[str]:
    """The fenced code blocks of a section of docs/getting-started.md."""
    section = (DOCS / doc).read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    yield from re.findall(r"```[a-z]*\n(.*?)```", section, flags=re.S)


def _command(block: str, program: str) -> list[str]:
    """The arguments after `program` of a shell block's command (continuation lines joined)."""
    words = shlex.split(block.replace("\\\n", " "))
    return words[words.index(program) + 1 :]


def test_lightning_cli_runs_on_the_neuron_accelerator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script, command = _blocks("getting-started.md", "## LightningCLI")
    (tmp_path / "train.py").write_text(script)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", *_command(command, "train.py")])
    trainers: list[Trainer] = []
    fit = Trainer.fit

    def recorded_fit(self: Trainer, *args: object, **kwargs: object) -> None:
        trainers.append(self)
        fit(self, *args, **kwargs)  # type: ignore[arg-type]  # LightningCLI's own arguments

    monkeypatch.setattr(Trainer, "fit", recorded_fit)
    runpy.run_path(str(tmp_path / "train.py"), run_name="__main__")
    (trainer,) = trainers
    assert isinstance(trainer.accelerator, lightning_trn.NeuronAccelerator)
    assert isinstance(trainer.strategy, lightning_trn.SingleDeviceNeuronStrategy)
    assert trainer.global_step == 4
    assert (tmp_path / "lightning_logs" / "version_0" / "config.yaml").is_file()


@pytest.mark.native_only  # a second here, most of a minute of XLA:CPU compiles; XLA's load: test_pretrained.py
def test_own_module_fine_tunes_a_folder_and_exports_a_hugging_face_folder(
    folder: Folder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    module_block, export_block = _blocks("getting-started.md", "## Your own module")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny-llama").symlink_to(folder.path)
    vocab = AutoTokenizer.from_pretrained(folder.path).vocab_size
    ids = torch.randint(0, vocab, (8, 16), generator=torch.Generator().manual_seed(0))
    exec(module_block, {"__name__": "doc", "loader": torch.utils.data.DataLoader(ids, batch_size=4)})
    consolidate.main(_command(export_block, "lightning_trn.consolidate"))
    exported = AutoModelForCausalLM.from_pretrained("exported/mine")
    AutoTokenizer.from_pretrained("exported/mine")
    trained = torch.load("runs/mine/checkpoints/last.ckpt", weights_only=True)["state_dict"]
    assert trained["model.model.norm.weight"].abs().sum() > 0
    for name, value in exported.state_dict().items():
        assert torch.equal(value, trained[f"model.{name}"]), name
    original = load_file(folder.path / "model.safetensors")
    assert not torch.equal(exported.model.norm.weight, original["model.norm.weight"])  # the trained weights
