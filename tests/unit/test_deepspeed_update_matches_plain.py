"""A user's own DeepSpeed loop with SGD applies single-process plain's step, within float32's rounding of
the write: an untied tiny Llama with an odd vocabulary (211: ZeRO's partition boundaries fall inside the
embedding and the head), T 53 in chunks of 8 (head 7), each rank padded differently (its own count of
valid tokens), float32, every method on ZeRO-1, 2 and 3 over two gloo ranks (`verify_deepspeed`,
`optimizer="sgd"`). Without ranks: the per-rank padding and the update's judge, which fails a doubled or
stale update and passes one a grid point off."""

from __future__ import annotations

import pytest
import torch

from streambp_core.models import load_config
from streambp_core.parallel.launch import available_cpus
from streambp_core.step.parts.batch import random_batch
from streambp_core.verify.deepspeed_update import rank_padded, update_ratio
from streambp_core.verify.methods import VerifySpec

two_cores = pytest.mark.skipif(available_cpus() < 2, reason="needs two CPU cores for two ranks")
METHODS = ("plain", "checkpoint", "mst", "streambp")


@pytest.mark.parametrize("padding", ["right", "left"])
def test_each_rank_pads_its_rows_differently(padding):
    batch = random_batch(vocab_size=211, seq_len=53, batch_size=2, padding=padding, seed=1)
    counts = [rank_padded(batch, rank, padding).attention_mask.sum(dim=1).tolist() for rank in range(3)]
    assert counts[0] == batch.attention_mask.sum(dim=1).tolist()
    assert [c - 7 for c in counts[0]] == counts[1]  # 53 // 8 + 1 positions more a rank
    assert [c - 14 for c in counts[0]] == counts[2]
    padded = rank_padded(batch, 1, padding)
    real = padded.attention_mask.bool()
    side = real[:, 0] if padding == "right" else real[:, -1]
    assert side.all()  # the real tokens stay on their side
    assert (padded.labels[~real] == -100).all() and (padded.input_ids[~real] == 0).all()
    assert torch.equal(padded.labels[real], batch.labels[real])
    few = random_batch(vocab_size=211, seq_len=8, batch_size=2, padding=padding, seed=1)
    assert rank_padded(few, 5, padding).attention_mask.sum(dim=1).tolist() == [2, 2]  # two real tokens kept


def test_an_update_off_plains_step_fails_and_one_grid_point_off_passes():
    """SGD's update judged within float32's rounding: the engine's update equal to plain's float32 step,
    or one float32 grid point off it where plain's own write rounds that far, passes; twice plain's step (a
    gradient reduced twice) or none (reduced before its last firing and lost) fails."""
    params = torch.ones(64)  # a norm's weight: float32's grid 1.2e-7 apart
    exact = {"w": -1e-2 * torch.linspace(1e-3, 2e-3, 64, dtype=torch.float64)}  # lr 1e-2, steps ~1e-5
    plain = {"w": (params - exact["w"].neg().float()) - params}
    assert float((plain["w"].double() - exact["w"]).norm()) > 0  # the write rounds
    assert update_ratio(plain, plain, exact, 1e-5) == (0.0, "w")
    ulp = torch.zeros(64)
    ulp[3] = 1.2e-7
    assert update_ratio({"w": plain["w"] + ulp}, plain, exact, 1e-5)[0] <= 1.0
    assert update_ratio({"w": 2 * plain["w"]}, plain, exact, 1e-5)[0] > 100
    assert update_ratio({"w": torch.zeros(64)}, plain, exact, 1e-5)[0] > 100


def _odd_llama(tmp_path) -> str:
    """The untied tiny Llama (hidden 64, 2 layers, 4 heads, 2 KV heads) with vocabulary 211, as a config
    directory (`load_config` reads one)."""
    config = load_config("tiny/llama")
    assert not config.tie_word_embeddings
    config.vocab_size = 211
    config.save_pretrained(tmp_path)
    return str(tmp_path)


@two_cores
@pytest.mark.slow
def test_the_users_sgd_loop_applies_plains_step_on_every_stage(tmp_path):
    """Every method's applied update on ZeRO-1/2/3 against single-process plain's SGD step: the reduced
    gradient within float32's bound of plain's, the update exactly SGD's step on it, and within float32's
    rounding of plain's own step (`update_ratio`), each parameter reduced once."""
    pytest.importorskip("deepspeed")
    from streambp_core.verify.deepspeed import verify_deepspeed

    spec = VerifySpec.of(model=_odd_llama(tmp_path), methods=METHODS, dtype="float32", padding="right",
                         seq_len_tokens=53, batch_size=2, partition_size=8, head_partition_size=7)
    results = verify_deepspeed((spec,), nproc=2, shards=("zero1", "zero2", "zero3"), optimizer="sgd",
                               timeout_s=600)
    assert {(r.method, r.shard) for r in results} == {(m, s) for m in METHODS
                                                       for s in ("zero1", "zero2", "zero3")}
    for r in results:
        assert r.grad_err <= 1e-5, (r.method, r.shard, r.grad_err, r.worst_param)
        assert r.step_err == 0.0, (r.method, r.shard, r.step_err)
        assert r.optimizer == "sgd" and r.update_ratio is not None and r.update_ratio <= 1.0, \
            (r.method, r.shard, r.update_ratio, r.update_err)
        assert set(r.reductions) == {"1"}, (r.method, r.shard, r.reductions)
        assert r.ok
