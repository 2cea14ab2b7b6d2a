"""The hooks into Lightning's internals (`lightning_trn.hooks.registry`) are in place only while a Neuron run is,
so other Lightning runs in the process are unchanged: `import lightning_trn` leaves Lightning's code as it is, a
Neuron fit installs them, its teardown (also after an exception) puts Lightning's originals back, and a CPU run in
the same process runs Lightning's own code. Run by both suites."""

from __future__ import annotations

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer
from models import RegressionModel, regression_loader

from lightning_trn.hooks import registry as lightning_hooks

pytestmark = pytest.mark.both

QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


def current() -> dict[str, object]:
    """What each hooked attribute holds now (`None`: the owner does not define it)."""
    return {f"{id(h.owner)}.{h.name}": h.owner.__dict__.get(h.name) for h in lightning_hooks.HOOKS}


#: Lightning's own attributes, taken at collection time, after `import lightning_trn` (the import above)
LIGHTNING = current()


class Seen(Callback):
    """What the hooked attributes hold while the run trains."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.during = current()


def fit(accelerator: str, model: RegressionModel | None = None) -> dict[str, object]:
    seen = Seen()
    Trainer(accelerator=accelerator, max_steps=2, callbacks=[seen], **QUIET).fit(
        model or RegressionModel(), regression_loader(n=64)
    )
    return seen.during


def test_import_leaves_lightning_as_it_is():
    assert "__setattr__" not in LightningModule.__dict__  # nn.Module's, inherited
    assert all(value is None or "lightning_trn" not in getattr(value, "__module__", "") for value in LIGHTNING.values())


def applicable() -> set[str]:
    """The hooks that apply to this process's backend (the activation-checkpointing fence and `torch.xla` are XLA's
    only), as `registry.acquire` decides."""
    return {
        f"{id(h.owner)}.{h.name}" for h in lightning_hooks.HOOKS if h.make(h.owner.__dict__.get(h.name)) is not None
    }


def test_a_neuron_run_hooks_lightning_for_its_duration_only():
    during = fit("neuron")
    hooked = applicable()
    assert len(hooked) >= len(LIGHTNING) - 3
    assert all(during[name] is not LIGHTNING[name] for name in hooked), "every applicable hook installed during the run"
    assert all(during[name] is LIGHTNING[name] for name in set(LIGHTNING) - hooked)
    assert current() == LIGHTNING
    assert fit("cpu") == LIGHTNING  # a CPU run afterwards runs Lightning's own code
    assert current() == LIGHTNING


class Fails(RegressionModel):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("user error")


def test_a_failed_neuron_run_restores_lightning_too():
    with pytest.raises(RuntimeError, match="user error"):
        fit("neuron", Fails())
    assert current() == LIGHTNING


def test_the_host_length_check_answers_as_lightnings():
    """`has_len_all_ranks` with the sum on the host: Lightning's answers, warnings and errors, for a Neuron strategy
    (whose `reduce` then gets a host tensor); any other strategy goes to Lightning's function as it is."""
    import warnings

    import torch
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.utilities.data import has_len_all_ranks
    from torch.utils.data import DataLoader

    from lightning_trn.hooks.loop_shortcuts import host_length_check
    from lightning_trn.pytorch.strategies import SingleDeviceNeuronStrategy

    class Recording(SingleDeviceNeuronStrategy):
        def reduce(self, tensor, *args, **kwargs):
            self.reduced = tensor
            return super().reduce(tensor, *args, **kwargs)

    on_host = host_length_check(has_len_all_ranks)
    cpu = SingleDeviceStrategy(torch.device("cpu"))
    for loader in (regression_loader(n=64), DataLoader([])):
        neuron = Recording()
        answers = []
        for check, strategy in ((has_len_all_ranks, cpu), (on_host, neuron), (on_host, cpu)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                answers.append((check(loader, strategy), [str(w.message) for w in caught]))
        assert answers[0] == answers[1] == answers[2]
        assert neuron.reduced.device.type == "cpu"
    assert answers[0][1] and "across ranks is zero" in answers[0][1][0]  # the empty loader's warning
