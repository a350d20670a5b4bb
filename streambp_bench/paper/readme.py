"""`results/README.md` from the results CSVs alone: our numbers beside the paper's, each row labelled.

The page is the template's intro (`readme_template.md`, through `prose`), then each item's section
whose CSV is in the folder (`items.ITEMS`, in their order), the step-time sections of the benchmarks'
CSVs (`step_time`), and the template's model coverage and list of cells that moved.
"""

from __future__ import annotations

from pathlib import Path

from streambp_bench.paper import host_tiers
from streambp_bench.paper.items import ITEMS
from streambp_bench.paper.prose import prose
from streambp_bench.paper.published import PAPER
from streambp_bench.paper.shared import frame_of
from streambp_bench.paper.step_time import step_sections


def render(out_dir: Path) -> str:
    """The README text for every item whose CSV is in `out_dir`."""
    lines = [prose("intro", paper=PAPER), ""]
    for name, item in ITEMS.items():
        frame = frame_of(out_dir / f"{name}.csv")
        if frame is not None and len(frame):
            lines += item.section(frame)
    lines += host_tiers.readme_lines(out_dir)  # the offload item's tier grid, one CSV per GPU, one section
    lines += step_sections(out_dir)
    return "\n".join([*lines, prose("models"), "", prose("changes"), ""])
