"""Llama 4 text (`llama4_text`): chunked local attention counted as transformers' mask counts it, NoPE layers
with the query temperature by index, q/k L2 norms after complex RoPE, a sigmoid top-1 MoE with a shared
expert beside dense layers; every method's gradients equal plain's in float64."""

from __future__ import annotations

import pytest
import torch

import streambp_core
from streambp_core.models import build_model, load_config
from streambp_core.models.adapters import layer_parts
from streambp_core.models.load import tiny_config
from tests.unit.test_exactness import assert_matches_plain, batch, relative_errors, step

CHUNK = 16
"""The tiny preset's attention_chunk_size: 40 tokens cross it twice."""


def model_of(**overrides):
    return build_model(tiny_config("llama4", **overrides), dtype=torch.float64, seed=0)


def test_the_tiny_models_layers_reach_the_engine() -> None:
    """Layer 0: RoPE, q/k norms, chunks of 16, dense MLP; layer 1: NoPE, full attention, the query
    temperature, the mixture of experts (a pair out, its router the engine's)."""
    layers = build_model("tiny/llama4", device="meta").model.layers
    rope_layer, nope_layer = (layer_parts(layer) for layer in layers)
    rope_attention = (rope_layer.rotary, rope_layer.attention_chunk, rope_layer.query_temperature)
    assert rope_attention == (True, CHUNK, None)
    assert rope_layer.q_norm is layers[0].self_attn.qk_norm and rope_layer.qk_norm_after_rope
    assert rope_layer.rope_complex and rope_layer.router is None and not rope_layer.mlp_pair
    assert type(rope_layer.mlp).__name__ == "Llama4TextMLP" and rope_layer.mlp.up_proj.out_features == 128
    nope_attention = (nope_layer.rotary, nope_layer.attention_chunk, nope_layer.query_temperature)
    assert nope_attention == (False, None, (8, 0.1))
    assert nope_layer.q_norm is None and nope_layer.mlp_pair
    assert nope_layer.router is layers[1].feed_forward.router


@pytest.mark.parametrize("padding", ["right", "left"])
def test_every_method_matches_plain(padding) -> None:
    """40 tokens in chunks of 5 (not a divisor of the attention chunk 16) over 2 rows padded differently."""
    model = model_of()
    ids, mask = batch(model.config.vocab_size, 2, 40, padding)
    assert_matches_plain(model, ids, mask, partition_size=5, head_partition_size=4)


@pytest.mark.parametrize("overrides", [{"attention_chunk_size": 4096}, {"attn_temperature_tuning": False},
                                       {"use_qk_norm": False}, {"no_rope_layers": [1, 1]}],
                         ids=["no-chunks", "no-temperature", "no-qk-norm", "no-nope"])
def test_each_feature_moves_the_loss(overrides) -> None:
    """The exactness tests exercise each feature: switched off, the loss of the same batch changes."""
    ids, mask = batch(512, 2, 40, "left")
    losses = [step(model, "plain", ids, mask)[0] for model in (model_of(), model_of(**overrides))]
    assert abs(losses[0] - losses[1]) > 1e-6


def test_chunks_count_from_each_rows_first_real_token() -> None:
    """The engine's chunks are those of transformers' chunked mask (`create_chunked_causal_mask`) with left
    padding: row 1's chunks start 5 tokens later than its index 0 does."""
    from transformers.masking_utils import create_chunked_causal_mask

    from streambp_core.engine.chunks import allowed_mask, local_chunks

    model = model_of()
    ids, mask = batch(model.config.vocab_size, 2, 40, "left")
    assert mask[1, :5].sum() == 0 and mask[1, 5] == 1
    hf = create_chunked_causal_mask(config=model.config, inputs_embeds=model.model.embed_tokens(ids),
                                    attention_mask=mask, cache=None, position_ids=torch.arange(40)[None])
    local = local_chunks(CHUNK, mask.bool(), None, (2, 40), "cpu")
    ours = local.narrow(mask.bool(), 0, 40, 0) & allowed_mask(40, None, 40)
    assert torch.equal(hf[:, 0], ours)
    assert local.ids[1, 5 + CHUNK - 1] == local.ids[1, 5] == 0 and local.ids[1, 5 + CHUNK] == 1


def test_a_model_built_by_transformers_matches_plain() -> None:
    """The user's path: AutoModelForCausalLM.from_config, float64, with the router's sigmoid widened as
    `build_model` widens it (`models.precision`: transformers' float32 sigmoid rounds a token's expert
    weight differently in a shorter call, one float32 step)."""
    from transformers import AutoModelForCausalLM

    from streambp_core.models.precision import routers_in_at_least_float32

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_config("tiny/llama4"), dtype=torch.float64)
    assert routers_in_at_least_float32(model, torch.float64) == 1
    for padding in ("left", "right"):
        ids, mask = batch(model.config.vocab_size, 2, 40, padding, seed=3)
        assert_matches_plain(model, ids, mask, methods=("mst", "streambp"), partition_size=6,
                             head_partition_size=5)


def test_packed_rows_chunk_each_document_from_its_start() -> None:
    from streambp_core.engine.packing import position_ids_from_lengths

    model = model_of()
    positions = position_ids_from_lengths([7, 20, 13])
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    ref_loss, ref = step_packed(model, "plain", ids, positions)
    for method in ("streambp", "mst"):
        loss, grads = step_packed(model, method, ids, positions)
        assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
        assert max(relative_errors(grads, ref).values()) <= 1e-12, method


def step_packed(model, method, ids, positions):
    model.zero_grad(set_to_none=True)
    with streambp_core.prepare(model, method, partition_size=6, head_partition_size=5) as run:
        loss = run.loss(ids, position_ids=positions)
        loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_complex_rope_and_its_transpose_are_transformers_bit_for_bit() -> None:
    """The rotation is `apply_rotary_emb`'s; its transpose is the rotation's backward as autograd takes it."""
    from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

    from streambp_core.engine.stream.rope import Rope, rope_transpose, rotate

    gen = torch.Generator().manual_seed(0)
    freqs = torch.polar(torch.ones(1, 5, 4), torch.randn(1, 5, 4, generator=gen))  # (1, T, hd / 2)
    rope = Rope.of(freqs.real, freqs.imag, as_complex=True)
    for dtype in (torch.float64, torch.float32):
        q = torch.randn(2, 5, 3, 8, generator=gen, dtype=dtype, requires_grad=True)  # (B, T, H, hd)
        q_hf, _ = apply_rotary_emb(q, q, freqs)
        assert torch.equal(rotate(q.transpose(1, 2), rope), q_hf.transpose(1, 2))
        grad = torch.randn(2, 5, 3, 8, generator=gen, dtype=dtype)
        (expected,) = torch.autograd.grad(q_hf, q, grad)
        assert torch.equal(rope_transpose(grad.transpose(1, 2), rope), expected.transpose(1, 2))


def test_the_router_loss_is_not_added() -> None:
    """Llama 4's causal LM adds no load-balancing loss, output_router_logits or not."""
    from streambp_core.engine.stream.router import router_aux

    assert router_aux(tiny_config("llama4", output_router_logits=True)) is None
    model = model_of(output_router_logits=True)
    ids, mask = batch(model.config.vocab_size, 2, 24, "right")
    assert_matches_plain(model, ids, mask, methods=("streambp", "mst"), partition_size=5,
                         head_partition_size=4)


def test_a_simulated_step_runs_the_chunked_layers() -> None:
    """Simulated in bfloat16, streambp and the baselines run a chunked layer on meta tensors."""
    from streambp_core.config import StepSpec
    from streambp_core.step.simulation.simulate import simulate

    for method in ("streambp", "checkpoint"):
        spec = StepSpec.of(model="tiny/llama4", method=method, seq_len_tokens=128, partition_size=32,
                           head_partition_size=16, dtype="bfloat16")
        result = simulate(spec)
        assert result.peak_bytes > 0


def test_a_chunk_of_one_position_runs_in_blocks_and_matches_plain(monkeypatch) -> None:
    """attention_chunk_size 1 (each query sees only itself): the engine attention of the baselines (theirs
    on the meta device, where max-len searches) takes whole chunks in blocks of `LOCAL_BLOCK_TOKENS`
    queries, so 300 tokens are 2 calls per chunked layer, not 300 (a 2-layer toy's max-len search took
    minutes), and it still matches transformers' chunked attention."""
    from streambp_core.engine.attention import hf

    calls, attend = [], hf.prefix_attention

    def counted(q, *args, **kwargs):
        calls.append(q.shape[2])  # queries per call
        return attend(q, *args, **kwargs)

    monkeypatch.setattr(hf, "prefix_attention", counted)
    model = model_of(attention_chunk_size=1)
    ids, mask = batch(model.config.vocab_size, 2, 300, "left")
    assert_matches_plain(model, ids, mask, methods=("checkpoint", "mst"), partition_size=64,
                         head_partition_size=32, baseline_attention="engine")  # plain: transformers' own
    blocks = (hf.LOCAL_BLOCK_TOKENS, 300 - hf.LOCAL_BLOCK_TOKENS)
    assert calls and min(calls) == blocks[1] and calls.count(blocks[0]) == calls.count(blocks[1]) > 0
