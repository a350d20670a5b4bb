"""The `reproduce offload` README section from rows: the gap to streambp + offload, slopes, targets."""

from __future__ import annotations

from streambp_bench.paper.offload import memory_figure
from streambp_bench.paper.offload import section as offload_section
from streambp_bench.results import ResultRow, rows_to_frame

MODEL = "Qwen/Qwen3-8B"


def _row(method: str, offload: str, metric: str, value: float | None, tokens: int = 0, **extra) -> ResultRow:
    return ResultRow(method=method, offload=offload, model=MODEL, metric=metric, value=value,
                     seq_len_tokens=tokens, source="simulated", device_name="meta", budget_gib=80.0,
                     status="ok" if value is not None else "oom", **extra)


def _frame(streambp_offload_tokens: float, slope_gib_per_k: float):
    lengths = {("checkpoint", "none"): 100_000.0, ("checkpoint", "checkpoints"): 250_000.0,
               ("streambp", "none"): 170_000.0, ("streambp", "checkpoints"): streambp_offload_tokens}
    rows = [_row(m, o, "max_len", v, peak_allocated_gib=79.0, host_peak_gib=100.0 if o != "none" else 0.0,
                 to_host_gib=100.0 if o != "none" else 0.0) for (m, o), v in lengths.items()]
    rows += [_row("streambp", "checkpoints", "peak_memory", 30 + slope_gib_per_k * t / 1000, t,
                  peak_allocated_gib=30 + slope_gib_per_k * t / 1000, host_peak_gib=t / 4000)
             for t in (100_000, 500_000, 1_000_000)]
    rows.append(_row("streambp", "checkpoints", "peak_memory", None, 2_000_000, peak_allocated_gib=95.0))
    return rows_to_frame(rows)


def test_the_section_gives_each_rows_gap_to_streambp_offload_and_judges_the_targets() -> None:
    text = "\n".join(offload_section(_frame(1_600_000, 0.03)))
    assert "| Qwen/Qwen3-8B | checkpoint + offload | 250,000 | 79.0 | 100.0 | 100.0 | 0.156 |" in text
    assert "| Qwen/Qwen3-8B | streambp + offload | 1,600,000 | 79.0 | 100.0 | 100.0 | 1.000 |" in text
    assert "| streambp + offload | 0.0300 |" in text
    assert "1,600,000 tokens (target >= 1,500,000: met)" in text and "(target <= 0.035: met)" in text
    missed = "\n".join(offload_section(_frame(1_400_000, 0.04)))
    assert "(target >= 1,500,000: not met)" in missed and "(target <= 0.035: not met)" in missed


def test_the_figure_draws_device_and_host_axes() -> None:
    fig = memory_figure(_frame(1_600_000, 0.03))
    device, host = fig.axes
    assert device.get_ylabel().startswith("device") and host.get_ylabel().startswith("host")
    assert [line.get_label() for line in host.get_lines()] == ["streambp + offload: host"]
