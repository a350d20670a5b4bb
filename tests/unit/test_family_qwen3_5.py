"""Qwen3.5 (`qwen3_5_text`, `qwen3_5_moe_text`) and Qwen3-Next (`qwen3_next`): Gated DeltaNet
linear-attention layers streamed through their recurrent state and conv halo, gated full attention;
every parameter's gradient equals plain's in float64."""

from __future__ import annotations

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.models.adapters import layer_parts
from streambp_core.models.load import build_model, load_config, tiny_config
from tests.unit.test_exactness import assert_matches_plain, batch


def model_of(family: str = "qwen3.5", **overrides):
    return build_model(tiny_config(family, **overrides), dtype=torch.float64, seed=0)


def test_the_tiny_preset_has_a_linear_and_a_gated_full_layer() -> None:
    layers = build_model("tiny/qwen3.5", device="meta").model.layers
    linear, full = (layer_parts(layer) for layer in layers)
    assert linear.delta is not None and linear.delta.module is layers[0].linear_attn
    assert full.delta is None and full.attn_output_gate and full.q_norm is not None
    assert full.q_proj.weight.shape[0] == 2 * full.num_heads * full.head_dim  # [query, gate] per head
    assert linear.delta.kernel_size == 4 and linear.delta.module.num_k_heads < linear.delta.module.num_v_heads


DEFAULT_PADDING = {("left", "qwen3.5"), ("right", "qwen3.5-moe"), ("right", "qwen3-next")}
"""(padding, family) of the padding matrix run by default: every family, each padding side."""


@pytest.mark.parametrize(("padding", "family"), [  # each family by default, its other padding slow
    pytest.param(padding, family, marks=() if (padding, family) in DEFAULT_PADDING else pytest.mark.slow)
    for padding in ("right", "left") for family in ("qwen3.5", "qwen3.5-moe", "qwen3-next")])
def test_every_method_matches_plain_with_padding(padding, family) -> None:
    """Several chunks per layer (23 tokens in chunks of 5): the state, its gradient and the halo cross
    four boundaries; padding on either side is masked before the projections, as transformers does.
    Qwen3.5-MoE: the same layers with a routed MLP (a shared expert behind a sigmoid gate); Qwen3-Next:
    fused projections of the linear attention, and a dense MLP in its `mlp_only_layers`."""
    model = model_of(family)
    ids, mask = batch(model.config.vocab_size, 2, 23, padding)
    assert_matches_plain(model, ids, mask, partition_size=5, head_partition_size=4)


@pytest.mark.slow
@pytest.mark.parametrize("partition_size", [1, 2, 3, 40], ids=["one", "two", "kernel-1", "larger"])
def test_chunks_shorter_than_the_conv_halo(partition_size) -> None:
    """Chunks of fewer than K - 1 = 3 tokens: a halo spans several chunks before it, and its gradient
    goes back through each of them; one chunk longer than the sequence."""
    model = model_of()
    ids, mask = batch(model.config.vocab_size, 2, 10, "left")
    assert_matches_plain(model, ids, mask, methods=("streambp",), partition_size=partition_size,
                         head_partition_size=partition_size)


@pytest.mark.slow
def test_three_linear_layers_and_a_full_one() -> None:
    """The published layout (3 linear layers, then a full one), grouped linear heads of another size."""
    model = model_of(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                     linear_num_key_heads=1, linear_key_head_dim=12, linear_value_head_dim=4)
    ids, mask = batch(model.config.vocab_size, 2, 21, "right")
    assert_matches_plain(model, ids, mask, methods=("streambp",), partition_size=6, head_partition_size=5)


@pytest.mark.parametrize("padding", ["right", pytest.param("left", marks=pytest.mark.slow)])
def test_a_users_own_float64_model_matches_plain(padding) -> None:
    """The user's path: AutoModelForCausalLM.from_config, not the package's build_model. Its float32
    islands (norms, decay, delta rule) compute in float64 while a run is open, for every method, and get
    transformers' forwards back when it closes."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_config("tiny/qwen3.5"), dtype=torch.float64).train()
    for param in model.parameters():  # transformers zero-initialises the norms' (1 + weight)
        torch.nn.init.normal_(param, std=0.2)
    ids, mask = batch(model.config.vocab_size, 2, 19, padding)
    assert_matches_plain(model, ids, mask, partition_size=4, head_partition_size=4)
    assert not any("forward" in vars(module) for module in model.modules())


def test_the_float64_delta_rule_runs_in_float64_and_a_float32_model_is_transformers() -> None:
    from streambp_core.models.precision import hybrid_in_at_least_float32

    wide = model_of().model.layers[0].linear_attn
    assert "forward" in vars(wide)
    narrow = build_model("tiny/qwen3.5", dtype=torch.float32).model.layers[0].linear_attn
    assert "forward" not in vars(narrow)
    assert hybrid_in_at_least_float32(build_model("tiny/qwen3", dtype=torch.float64), torch.float64) == []
    x = torch.randn(1, 5, 64, dtype=torch.float64)
    captured = []
    handle = wide.norm.register_forward_hook(lambda module, args, out: captured.append(args[0].dtype))
    wide(x)
    handle.remove()
    assert captured == [torch.float64]  # the delta rule's output, float32 in transformers' own forward


def test_the_simulator_sees_every_boundarys_state_and_halo() -> None:
    """On meta tensors, with only the first and last chunks run (`keep_chunks`), the saved states and
    halos are still one per chunk boundary of the whole sequence."""
    from streambp_core.engine.stream.delta import delta_forward
    from streambp_core.engine.stream.layer import LayerPlan

    model = build_model("tiny/qwen3.5", device="meta", dtype=torch.bfloat16)
    parts = layer_parts(model.model.layers[0])
    plan = LayerPlan(parts, partition_size=8, attn="auto", keep_chunks=1)
    h_in = torch.empty(2, 100, 64, device="meta", dtype=torch.bfloat16)
    _, states, halos = delta_forward(plan, h_in, None)
    module = parts.delta.module
    assert states.shape == (12, 2, module.num_v_heads, module.head_k_dim, module.head_v_dim)
    assert states.dtype == torch.float32  # transformers' delta rule keeps its state in float32
    assert halos.shape == (13, 2, module.conv_dim, 3)


def test_packed_rows_are_refused_by_name() -> None:
    model = model_of()
    ids, _ = batch(model.config.vocab_size, 1, 12, "none")
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    for method in ("plain", "streambp"):
        with streambp_core.prepare(model, method) as run, pytest.raises(ConfigError, match="Gated DeltaNet"):
            run.loss(ids, position_ids=positions)


def test_sequence_parallelism_is_refused_by_name() -> None:
    from streambp_core.engine.sequence.group import SequenceGroup

    model = build_model("tiny/qwen3.5", device="meta", dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="sequence parallelism does not run with Gated DeltaNet"):
        streambp_core.prepare(model, "streambp", sequence_group=SequenceGroup.simulated(2))



def test_the_router_loss_with_gated_deltanet_layers_is_refused_by_name() -> None:
    model = build_model(tiny_config("qwen3.5-moe", output_router_logits=True), device="meta")
    with pytest.raises(ConfigError, match="load-balancing loss .* Gated DeltaNet"):
        streambp_core.prepare(model, "streambp")


@pytest.mark.parametrize("method", ["plain", "checkpoint"])
def test_the_baselines_under_the_engine_attention_mask_the_linear_layers(method) -> None:
    """Under the engine attention (the CLI's baselines, the simulator's) the attention layers take a
    (B, 1, 1, T) mask, for which transformers builds no padding mask for the linear layers: they get the
    (B, T) one, so the baseline computes transformers' own model on a padded batch."""
    from tests.unit.test_exactness import relative_errors, step

    model = model_of()
    ids, mask = batch(model.config.vocab_size, 2, 23, "left")
    ref_loss, ref = step(model, "plain", ids, mask)
    loss, grads = step(model, method, ids, mask, baseline_attention="engine")
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
    assert max(relative_errors(grads, ref).values()) <= 1e-12
