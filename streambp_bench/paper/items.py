"""Every item `streambp-bench reproduce` runs, in the order `all` runs them and the README shows them:
each writes `<item>.csv` (+ PNGs) and writes its README section from that CSV alone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from streambp_bench.paper import alst, fig3, fig5, offload, table1, table3, table4, table6
from streambp_bench.paper.shared import Settings


@dataclass(frozen=True)
class Item:
    """One reproduced item: its run and its README section."""

    run: Callable[[Settings], list[Path]]
    """Run what the item needs into the settings' folder; the files written besides its CSV."""
    section: Callable[[pd.DataFrame], list[str]]
    """The item's README lines from the rows of its CSV."""


ITEMS: dict[str, Item] = {
    name: Item(module.run, module.section)
    for name, module in (("fig3", fig3), ("fig5", fig5), ("table1", table1), ("table3", table3),
                         ("table4", table4), ("table6", table6), ("offload", offload),
                         ("alst", alst))
}
"""Every item."""
