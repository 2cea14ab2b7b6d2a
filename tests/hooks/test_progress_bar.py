"""The Neuron progress bars redraw on a clock (at most `max_redraws_per_second`), not on every batch.

Every redraw is host Python time (and, for Rich, a render thread taking the GIL), which an XLA training loop pays
directly; Lightning's stock bars redraw every batch (TQDM) or up to 100 times a second (Rich).
"""

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress import rich_progress, tqdm_progress
from models import RegressionModel

from lightning_trn.pytorch.callbacks.progress_bar import NeuronRichProgressBar, NeuronTQDMProgressBar

pytestmark = pytest.mark.xla_only

BATCHES = 32  # `regression_loader()`: 512 rows in batches of 16
STEP_SECONDS = 0.01  # the fake clock advances this much per batch: 100 steps/s


def fit_one_epoch(tmp_path, bar, redraw_clock) -> Trainer:
    trainer = Trainer(
        accelerator="neuron",
        max_epochs=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        callbacks=[bar, redraw_clock.advance_per_batch(STEP_SECONDS)],
    )
    trainer.fit(RegressionModel())
    return trainer


@pytest.mark.parametrize("bar_class", [NeuronTQDMProgressBar, TQDMProgressBar])
def test_tqdm_bar_redraws_on_the_clock_and_at_the_last_batch(tmp_path, monkeypatch, redraw_clock, bar_class):
    drawn = []
    real_update_n = tqdm_progress._update_n
    monkeypatch.setattr(tqdm_progress, "_update_n", lambda bar, n: drawn.append(n) or real_update_n(bar, n))

    trainer = fit_one_epoch(tmp_path, bar_class(), redraw_clock)

    assert isinstance(trainer.progress_bar_callback, NeuronTQDMProgressBar)  # the stock bar is replaced
    # 32 batches at 100 steps/s = 0.32 s: about 4 redraws at 10 per second, plus the last batch (stock: 32)
    assert drawn[-1] == BATCHES
    assert 3 <= len(drawn) <= 6, drawn


def test_rich_bar_thread_wakes_and_draws_at_most_max_redraws_per_second(tmp_path, monkeypatch, redraw_clock):
    soft_refreshes = []
    real_soft_refresh = rich_progress.CustomProgress.soft_refresh
    monkeypatch.setattr(
        rich_progress.CustomProgress, "soft_refresh", lambda self: soft_refreshes.append(1) or real_soft_refresh(self)
    )

    trainer = fit_one_epoch(tmp_path, RichProgressBar(), redraw_clock)  # stock bar, refresh_rate=100: replaced

    bar = trainer.progress_bar_callback
    assert isinstance(bar, NeuronRichProgressBar)
    assert bar.refresh_rate == 10  # the render thread's wake-ups per second (the stock bar's 100 is capped)
    # one redraw request per 0.1 s of the fake clock (0.32 s in all) plus the first, instead of several per batch
    assert 2 <= len(soft_refreshes) <= 5, len(soft_refreshes)


def test_redraw_rate_is_configurable_and_validated(redraw_clock):
    bar = NeuronTQDMProgressBar(max_redraws_per_second=2)
    assert bar._redraw_due()
    redraw_clock.now += 0.4
    assert not bar._redraw_due()
    assert bar._redraw_due(last=True)  # a loop's last batch is always drawn
    redraw_clock.now += 0.5
    assert bar._redraw_due()
    assert NeuronRichProgressBar(refresh_rate=3).refresh_rate == 3  # below the cap: the user's rate
    with pytest.raises(ValueError, match="max_redraws_per_second"):
        NeuronRichProgressBar(max_redraws_per_second=0)


def test_a_configured_stock_bar_keeps_every_option(tmp_path):
    from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme

    theme = RichProgressBarTheme(description="green_yellow", progress_bar="#6206E0")
    bars = [
        (
            TQDMProgressBar(refresh_rate=3, process_position=2, leave=True),
            NeuronTQDMProgressBar,
            {"refresh_rate": 3, "process_position": 2, "_leave": True},
        ),
        (
            RichProgressBar(refresh_rate=5, leave=True, theme=theme, console_kwargs={"width": 77}),
            NeuronRichProgressBar,
            {"refresh_rate": 5, "_leave": True, "theme": theme, "_console_kwargs": {"width": 77}},
        ),
    ]
    for bar, replacement, options in bars:
        trainer = Trainer(
            accelerator="neuron",
            max_steps=2,
            default_root_dir=tmp_path,
            logger=False,
            enable_checkpointing=False,
            callbacks=[bar],
        )
        trainer.fit(RegressionModel())
        used = trainer.progress_bar_callback
        assert type(used) is replacement
        assert {name: getattr(used, name) for name in options} == options


class OwnBar(TQDMProgressBar):
    """A user's subclass: left alone."""


def test_a_users_own_bar_is_kept_and_the_cost_said_once(tmp_path, caplog):
    bar = OwnBar()
    trainer = Trainer(
        accelerator="neuron",
        max_steps=2,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        callbacks=[bar],
    )
    trainer.fit(RegressionModel())
    assert trainer.progress_bar_callback is bar
    assert caplog.text.count("keeping your progress bar OwnBar") == 1
