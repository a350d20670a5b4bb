"""Table 4's checkpoint column under DeepSpeed ZeRO-2's allocations against the paper, on the committed
results: within ±15 % at 4-8 GPUs; the 3-GPU cell is reported as a known difference, not compared."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from streambp_bench.paper.table4 import AGREEMENT, AGREEMENT_GPUS, checkpoint_agreement, section

RESULTS = Path(__file__).resolve().parents[2] / "results" / "table4.csv"


@pytest.mark.skipif(not RESULTS.exists(), reason="no committed table4.csv")
def test_checkpoint_cells_agree_with_the_paper_at_four_to_eight_gpus():
    frame = pd.read_csv(RESULTS)
    ratios = checkpoint_agreement(frame)
    assert set(AGREEMENT_GPUS) <= set(ratios)
    for gpus in AGREEMENT_GPUS:
        assert abs(ratios[gpus] - 1) <= AGREEMENT, (gpus, ratios[gpus])
    text = "\n".join(section(frame))
    assert f"within ±{AGREEMENT:.0%}" in text and "At 3 GPUs" in text and "known difference" in text
