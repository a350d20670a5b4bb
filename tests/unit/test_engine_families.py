"""The 2026 families on the engines: torch FSDP2 (zero2, zero3) and DeepSpeed ZeRO-1/2/3 on two gloo CPU
ranks, every method's gradients against single-process plain in float64, through the library calls
`verify --nproc 2` and `verify --nproc 2 --engine deepspeed` make (`verify_sharded`, `verify_deepspeed`).

One tiny preset a kind: gpt-oss (attention sinks, biased router, experts as 3-D parameters), Gemma 2
(soft-caps, sandwich norms), Llama 4 text (chunked local attention, NoPE layers, a sigmoid top-1 MoE beside
dense layers), Qwen3.5 (Gated DeltaNet's conv, A_log and dt_bias beside gated attention), DeepSeek-V3 (MLA's
latent norms, group-limited routing) and OLMo 3 (a config-mapped llama-like: output norms, sliding layers).
Each 2-rank run takes tens of seconds on 2 cores: gpt-oss on FSDP2 zero3 (the hardest stage) runs by
default, the rest with `-m slow` (DeepSpeed's ZeRO-3 runs by default in test_parallel_deepspeed.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from streambp_core.config import ConfigError
from streambp_core.engine.engines.reduction import check_experts
from streambp_core.models import build_model, load_config
from streambp_core.parallel.launch import available_cpus
from streambp_core.verify.methods import VerifySpec

two_cores = pytest.mark.skipif(available_cpus() < 2, reason="needs two CPU cores for two ranks")

METHODS = ("plain", "checkpoint", "mst", "streambp")
FAMILIES = ["tiny/gpt-oss", "tiny/gemma2", "tiny/llama4", "tiny/qwen3.5", "tiny/deepseek-v3", "tiny/olmo3"]
DEFAULT = "tiny/gpt-oss"
"""The family that runs without `-m slow`: sinks and 3-D experts, the parameters most likely missed."""


def _spec(model: str, methods: tuple[str, ...] = METHODS) -> VerifySpec:
    """Two rows of 32 tokens a rank, right padding, 8-token chunks (4 a layer), float64."""
    return VerifySpec.of(model=model, methods=methods, dtype="float64", padding="right", seq_len_tokens=32,
                         batch_size=2, partition_size=8, head_partition_size=8)


def _families(default_runs: bool):
    """FAMILIES as parameters, all but `DEFAULT` slow (`DEFAULT` too unless `default_runs`)."""
    return [pytest.param(model, marks=() if default_runs and model == DEFAULT else pytest.mark.slow)
            for model in FAMILIES]


def _check_fsdp(model: str, shards: tuple[str, ...]) -> None:
    from streambp_core.verify.sharded import verify_sharded

    report = verify_sharded((_spec(model),), nproc=2, shards=shards, timeout_s=900)
    assert {(r.method, r.shard) for r in report.results} == {(m, s) for m in METHODS for s in shards}
    for r in report.results:  # float64 through FSDP2's reduce-scatter: float64's rounding
        assert r.max_rel_err <= 1e-12 and r.loss_abs_err <= 1e-12, (r.method, r.shard, r.max_rel_err,
                                                                     r.worst_param)
        assert r.ok


def _check_deepspeed(model: str, shards: tuple[str, ...]) -> None:
    pytest.importorskip("deepspeed")
    from streambp_core.verify.deepspeed import verify_deepspeed

    results = verify_deepspeed((_spec(model),), nproc=2, shards=shards, micro_steps=2, timeout_s=900)
    assert {(r.method, r.shard) for r in results} == {(m, s) for m in METHODS for s in shards}
    for r in results:  # ZeRO reduces and accumulates in float32 whatever the parameters' dtype: a few
        assert r.grad_err <= 1e-6, (r.method, r.shard, r.grad_err, r.worst_param)  # float32 roundings
        assert r.step_err == 0.0, (r.method, r.shard, r.step_err)
        assert set(r.reductions) == {"1"}, (r.method, r.shard, r.reductions)  # every parameter once
        assert r.ok


def _cells(hardest: tuple[str, ...], rest: tuple[str, ...], *, default_runs: bool = True):
    """(model, shards) parameters: the hardest stages for every family (`DEFAULT` by default, unless not
    `default_runs`), the rest slow."""
    hard = [pytest.param(p.values[0], hardest, marks=p.marks) for p in _families(default_runs)]
    return hard + [pytest.param(model, rest, marks=pytest.mark.slow) for model in FAMILIES]


@two_cores
@pytest.mark.parametrize("model, shards", _cells(("zero3",), ("zero2",)))
def test_fsdp2_every_method_has_plains_gradients(model, shards):
    _check_fsdp(model, shards)


@two_cores
@pytest.mark.parametrize("model, shards", _cells(("zero3",), ("zero1", "zero2"), default_runs=False))
def test_deepspeed_every_method_has_plains_gradients_reduced_once(model, shards):
    _check_deepspeed(model, shards)


class _ExpertList(nn.Module):
    """An MoE block holding one module per expert, as transformers 4's did."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


def test_zero3_refuses_only_per_expert_modules_without_leaf_marks():
    """Experts fused into 3-D parameters (every 2026 MoE family) fire one hook whatever the routing, so
    plain and checkpoint run on them unmarked; a block with one module per expert still needs its leaf
    mark, and is refused by name without it."""
    model = build_model(load_config("tiny/gpt-oss"), dtype=torch.float64, device="cpu", seed=0)
    layers = model.model.layers
    assert all(p.dim() == 3 for p in (layers[0].mlp.experts.gate_up_proj, layers[0].mlp.experts.down_proj))
    check_experts(layers, "plain", drives_modules=False)
    for layer in layers:
        layer.mlp = _ExpertList()
    with pytest.raises(ConfigError, match="checkpoint under deepspeed zero3 on a mixture-of-experts model "
                                          "needs its MoE blocks marked as leaf modules"):
        check_experts(layers, "checkpoint", drives_modules=False)
    check_experts(layers, "streambp", drives_modules=True)  # the units hand every expert over
    for layer in layers:
        layer.mlp._z3_leaf = True
    check_experts(layers, "checkpoint", drives_modules=False)
