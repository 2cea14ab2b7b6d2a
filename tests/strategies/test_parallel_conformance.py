"""The core of the parallel conformance sweep (`tests/conformance_parallel.py`, `CORE`): each cell (model family x
layout x training event) trains what one device trains, within the tolerance derived from the reference's own float32
error, or is refused before its first update with a paragraph. The cells are the eight cases the sweep was built for
(tied weights across stages, validation inside an accumulation window under pipeline x FSDP2, Qwen3's per-head norms
under tensor parallel, a smaller last batch through the stages, the recipe's stages under FSDP2, ZBVZeroBubble x
FSDP2, pipeline x tensor parallel with tied weights resumed mid-run) and one of each other family, layout and event.
The whole table: `python -m tests.conformance_parallel`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance_parallel import CORE, EXPECTED, Cell, sweep

# not `numerics`: the sweep runs its references under a second kernel set itself (their spread is part of each
# cell's bound), so a second pass of the module under another capability would repeat that
pytestmark = [pytest.mark.native_only, pytest.mark.slow]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """Every core cell run (one job per layout) and judged against the references (one process, float32 and
    float64)."""
    return sweep(list(CORE), Path(tmp_path_factory.mktemp("conformance")))


@pytest.mark.parametrize("cell", CORE, ids=[cell.name for cell in CORE])
def test_cell_equals_one_device_or_is_refused(verdicts: dict[str, tuple[str, str]], cell: Cell) -> None:
    verdict, detail = verdicts[cell.name]
    assert verdict == EXPECTED.get(cell, "equal"), f"{cell.name}: {verdict}: {detail}"
