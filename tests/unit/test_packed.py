"""Packed rows in float64: every method equals plain backprop on the same packed batch (transformers' own
packed path), for every family, with padding, windows, GQA and a mixture of experts; and packing is
invisible to the optimizer: the same gradients as each document in its own row."""

from __future__ import annotations

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.engine.packing import document_labels, packed_rows, position_ids_from_lengths
from streambp_core.models import build_model, tiny_config
from tests.unit.test_exactness import relative_errors

GRAD_RTOL = 1e-10
CHUNK = 5
"""Layer chunk of the tests. The documents [5, 7, 1, 10] then hold: one ending exactly at a chunk boundary
(5), one shorter than a chunk (1, a one-token document) and a chunk (10..15) spanning three documents."""
DOCS = (5, 7, 1, 10)
WINDOW = 4
"""A window shorter than the long documents, so the band and the document both cut a chunk's keys."""

FAMILIES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    "gemma3": ("gemma3", {"sliding_window": WINDOW}),  # layer 0 local, layer 1 global
    "qwen3-moe": ("qwen3-moe", {"output_router_logits": True, "router_aux_loss_coef": 0.5}),
    "mixtral": ("mixtral", {"sliding_window": WINDOW}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
}


def model_of(name: str):
    family, overrides = FAMILIES[name]
    return build_model(tiny_config(family, **overrides), dtype=torch.float64, seed=0)


def packed_batch(vocab: int, rows: list[list[int]], seq_len: int, seed: int = 3):
    """Token ids, attention mask (None without padding) and position_ids of rows packed from documents of
    the given lengths, each row padded on the right to `seq_len` (padding at position 0, as TRL pads)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(rows), seq_len), generator=gen)
    mask = torch.zeros(len(rows), seq_len, dtype=torch.long)
    positions = torch.zeros(len(rows), seq_len, dtype=torch.long)
    for row, lengths in enumerate(rows):
        used = sum(lengths)
        positions[row, :used] = position_ids_from_lengths(lengths)[0]
        mask[row, :used] = 1
    return ids, (None if bool(mask.all()) else mask), positions


def step(model, method, ids, mask, positions, labels=None, **options):
    model.zero_grad(set_to_none=True)
    with streambp_core.prepare(model, method, **options) as run:
        loss = run.loss(ids, attention_mask=mask, labels=labels, position_ids=positions)
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_close(got, ref, what):
    loss, grads = got
    ref_loss, ref_grads = ref
    assert abs(loss - ref_loss) <= GRAD_RTOL * abs(ref_loss), what
    assert grads.keys() == ref_grads.keys(), what
    for name, err in relative_errors(grads, ref_grads).items():
        assert err <= GRAD_RTOL, f"{what}: {name} relative error {err:.2e}"


def assert_methods_match_plain(model, ids, mask, positions, methods=("checkpoint", "mst", "streambp")):
    ref = step(model, "plain", ids, mask, positions)
    for method in methods:
        got = step(model, method, ids, mask, positions, partition_size=CHUNK, head_partition_size=4)
        assert_close(got, ref, method)
    return ref


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_method_matches_plain_on_packed_rows(name):
    """Batch 2: row 0 packs DOCS (23 tokens, no padding), row 1 packs [9, 6] and 8 padding tokens."""
    model = model_of(name)
    ids, mask, positions = packed_batch(model.config.vocab_size, [list(DOCS), [9, 6]], sum(DOCS))
    methods = ("checkpoint", "streambp") if name == "qwen3-moe" else ("checkpoint", "mst", "streambp")
    ref = assert_methods_match_plain(model, ids, mask, positions, methods)
    unpacked = step(model, "plain", ids, mask, None, labels=_labels(ids, mask, positions))
    assert relative_errors(unpacked[1], ref[1])["model.layers.0.self_attn.q_proj.weight"] > 1e-3


def test_left_padding_and_a_row_that_starts_mid_document():
    """Row 0: three padding tokens, then documents of 8 and 12 tokens; row 1 starts inside a document
    (positions 4, 5, ...), then two more."""
    model = model_of("mistral-window")
    ids = torch.randint(0, model.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 23, dtype=torch.long)
    mask[0, :3] = 0
    positions = torch.cat([torch.zeros(1, 3, dtype=torch.long), position_ids_from_lengths([8, 12])], dim=1)
    row1 = torch.cat([torch.arange(4, 11)[None], position_ids_from_lengths([9, 7])], dim=1)
    assert_methods_match_plain(model, ids, mask, torch.cat([positions, row1]))


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_engine_attention_baseline_matches_transformers_packed_path(name):
    model = model_of(name)
    ids, mask, positions = packed_batch(model.config.vocab_size, [list(DOCS), [9, 6]], sum(DOCS))
    ref = step(model, "plain", ids, mask, positions)
    for method in ("plain", "mst"):
        got = step(model, method, ids, mask, positions, baseline_attention="engine")
        assert_close(got, ref, f"{method} under the engine attention")


@pytest.mark.parametrize("name", ["qwen3", "mistral-window", "gemma3"])
def test_packing_is_invisible_to_the_optimizer(name):
    """The packed batch's gradients equal those of each document in its own (right-padded) row: the loss
    is the mean over the same targets and no document sees another."""
    model = model_of(name)
    rows = [list(DOCS), [9, 6]]
    ids, mask, positions = packed_batch(model.config.vocab_size, rows, sum(DOCS))
    packed = step(model, "streambp", ids, mask, positions, partition_size=CHUNK)
    docs = [(row, sum(lengths[:i]), n) for row, lengths in enumerate(rows) for i, n in enumerate(lengths)]
    alone = torch.zeros(len(docs), max(DOCS), dtype=torch.long)
    alone_mask = torch.zeros_like(alone)
    for i, (row, start, n) in enumerate(docs):
        alone[i, :n], alone_mask[i, :n] = ids[row, start:start + n], 1
    assert_close(step(model, "plain", alone, alone_mask, None), packed, "one row per document")


def test_documents_and_chunk_bands():
    """Document ids, lengths and each chunk's first key: a chunk that starts new documents in every row
    needs no prefix; a chunk whose rows start mid-document reaches back to the earliest document start."""
    _, mask, positions = packed_batch(16, [[4, 6], [3, 3, 2]], 10)
    packed = packed_rows(positions, mask, (2, 10))
    assert packed.lengths == ((4, 6), (3, 3, 2))
    assert packed.doc_ids.tolist() == [[1] * 4 + [2] * 6, [1] * 3 + [2] * 3 + [3] * 2 + [0] * 2]
    assert packed.chunk_keys(4, 6, 0)[0] == 3  # row 1's token 4 is in the document starting at 3
    assert packed.chunk_keys(6, 8, 0)[0] == 4
    first, allowed = packed.chunk_keys(6, 10, 0)
    assert first == 4 and allowed.shape == (2, 4, 6)
    assert allowed[1, 2].tolist() == [False, False, False, False, False, False]  # padding sees nothing
    assert allowed[1, 0].tolist() == [False, False, True, True, False, False]  # own document only
    assert packed_rows(torch.arange(10)[None], None, (2, 10)) is None  # 0..T-1: nothing packed
    assert document_labels(torch.arange(10)[None].expand(2, -1), packed)[1].tolist() == [
        -100, 1, 2, -100, 4, 5, -100, 7, -100, -100]


@pytest.mark.parametrize(
    ("positions", "mask", "message"),
    [
        ([[0, 1, 2, 1, 2, 3]], None, r"increase by 1 within a document.*row 0, token 3"),
        ([[0, 1, 3, 4, 0, 1]], None, r"increase by 1 within a document.*row 0, token 2"),
        ([[0, 1, 2, 0, 5, 6]], [[1, 1, 1, 0, 1, 1]], r"after padding must start at position 0"),
        ([[0, 1, 2, 0, 1]], None, r"position_ids shape \(1, 5\) does not match input_ids \(1, 6\)"),
        ([[[0, 1, 2, 0, 1, 2]]], None, r"position_ids shape \(1, 1, 6\)"),
    ],
)
def test_bad_position_ids_are_config_errors(positions, mask, message):
    model = model_of("llama")
    ids = torch.randint(0, 16, (1, 6))
    mask = None if mask is None else torch.tensor(mask)
    with streambp_core.prepare(model, "streambp") as run, pytest.raises(ConfigError, match=message):
        run.loss(ids, attention_mask=mask, position_ids=torch.tensor(positions))


def test_packing_on_the_meta_device_is_refused():
    with pytest.raises(ConfigError, match="packed rows need real position_ids, not meta tensors"):
        packed_rows(torch.tensor([[0, 1, 0, 1]], device="meta"), None, (1, 4))


@pytest.mark.parametrize("objective", ["grpo", "dpo"])
def test_packing_refused_for_sequence_objectives(objective):
    model = model_of("llama")
    ids = torch.randint(0, 16, (2, 6))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with streambp_core.prepare(model, "streambp", objective=objective) as run:
        with pytest.raises(ConfigError, match=f"packed rows .* cannot train the {objective} objective"):
            run.loss(ids, position_ids=positions)


def _labels(ids, mask, positions):
    return document_labels(ids, packed_rows(positions, mask, tuple(ids.shape)))
