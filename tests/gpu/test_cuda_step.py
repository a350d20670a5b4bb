"""On a CUDA device: the simulator against the caching allocator, and bf16 gradients by the flash-attention
rule. Skipped without CUDA (`gpu` marker, see conftest.py)."""

from __future__ import annotations

import pytest

from streambp_core.config import StepSpec
from streambp_core.models import load_config
from streambp_core.step.run.setup import build_setup
from streambp_core.step.search.probe import measure_setup
from streambp_core.step.simulation.simulate import simulate
from streambp_core.verify.methods import VerifySpec, verify_spec

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("method", ["checkpoint", "streambp"])
def test_simulated_peak_is_within_3_percent_of_the_allocators(method: str) -> None:
    """Qwen3-0.6B, 4k tokens, bf16: the allocator also holds cuBLAS workspace (~64 MiB), hence 3 %."""
    spec = StepSpec.of(model="Qwen/Qwen3-0.6B", method=method, seq_len_tokens=4096)
    config = load_config(spec.model)
    measured = measure_setup(build_setup(spec, config, "cuda"), "cuda")
    simulated = simulate(spec, config)
    assert measured.status == "ok" and measured.source == "measured-cuda"
    assert abs(measured.peak_bytes / simulated.peak_bytes - 1) <= 0.03


def test_bf16_gradients_follow_the_flash_attention_rule() -> None:
    spec = VerifySpec.of(model="Qwen/Qwen3-0.6B", seq_len_tokens=1024, batch_size=2, dtype="bfloat16",
                         padding="right", device="cuda", partition_size=256, head_partition_size=100)
    report = verify_spec(spec)
    assert report.ok, report.to_dict()
