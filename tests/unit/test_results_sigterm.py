"""A SIGTERM during a results rewrite leaves no temporary file beside the CSV (and the CSV whole)."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]

WRITER = """
import sys
from streambp_bench.results.csv_io import atomic_rewrite
records = [{"a": str(i), "b": "x" * 200} for i in range(100_000)]
print("ready", flush=True)
while True:
    atomic_rewrite(sys.argv[1], ["a", "b"], records)
"""


@pytest.mark.slow
def test_sigterm_mid_rewrite_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "r.csv"
    for attempt in range(3):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE,
                                  text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(1.5 + attempt)
        writer.send_signal(signal.SIGTERM)
        assert writer.wait(timeout=60) in (-signal.SIGTERM, 128 + signal.SIGTERM)
        leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        assert leftovers == []
        if target.exists():
            with target.open(newline="") as handle:
                assert len(list(csv.DictReader(handle))) == 100_000
