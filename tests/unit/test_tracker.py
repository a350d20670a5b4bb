"""MemoryTracker: exact byte counts of live storages, their peak and its breakdown by category.

Every expected figure is computed by hand from tensor shapes (float32 = 4 bytes).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from streambp_core.measure import (
    CATEGORIES,
    CHECKPOINTS,
    GIB,
    GRADS,
    KV,
    OPTIMIZER,
    TEMPORARIES,
    WEIGHTS,
    MemoryTracker,
    current_category,
    memory_category,
)

DEVICES = ["cpu", "meta"]
F32 = 4  # bytes per float32 element


def _zeros(**nonzero: int) -> dict[str, int]:
    return {name: nonzero.get(name, 0) for name in CATEGORIES}


# --- tags ---------------------------------------------------------------------------------------------


def test_memory_category_nests_and_restores() -> None:
    assert current_category() == TEMPORARIES
    with memory_category(CHECKPOINTS):
        assert current_category() == CHECKPOINTS
        with memory_category(KV):
            assert current_category() == KV
        assert current_category() == CHECKPOINTS
    assert current_category() == TEMPORARIES


def test_memory_category_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown memory category 'activations'"):
        memory_category("activations")


def test_allocations_are_filed_under_the_active_category() -> None:
    with MemoryTracker() as tracker:
        with memory_category(CHECKPOINTS):
            kept = torch.empty(100)
        with memory_category(KV):
            k = torch.empty(30)
        tmp = torch.empty(7)
    assert tracker.result().end_breakdown_bytes == _zeros(checkpoints=400, kv=120, temporaries=28)
    del kept, k, tmp


# --- storages, views, frees -----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_views_and_in_place_ops_add_nothing(device: str) -> None:
    with MemoryTracker() as tracker:
        a = torch.empty(1000, device=device)
        views = [
            a.view(10, 100),
            a[::2],
            a.view(10, 100).t(),
            a.reshape(100, 10),
            a.detach(),
            a[None].expand(3, -1),
        ]
        a.add_(1.0)
        a.view(10, 100).mul_(2.0)
        assert tracker.live_bytes == 1000 * F32
    assert tracker.result().peak_bytes == 1000 * F32
    del views


@pytest.mark.parametrize("device", DEVICES)
def test_frees_release_bytes_once_the_last_view_dies(device: str) -> None:
    with MemoryTracker() as tracker:
        a = torch.empty(1000, device=device)
        b = torch.empty(500, device=device)
        assert tracker.live_bytes == 6000
        del a
        assert tracker.live_bytes == 2000
        c = torch.empty(250, device=device)
        view = c[:10]
        del c
        assert tracker.live_bytes == 3000  # the view keeps c's storage alive
        del view
        assert tracker.live_bytes == 2000
    result = tracker.result()
    assert (result.peak_bytes, result.end_bytes) == (6000, 2000)
    assert result.device == device
    del b


def test_storages_made_before_entry_are_not_counted_nor_their_views() -> None:
    x = torch.ones(100)
    with MemoryTracker() as tracker:
        x_views = (x.view(10, 10).t(), x[1:], x.detach())
        x.add_(1.0)
        assert tracker.live_bytes == 0
        y = x * 2
        assert tracker.live_bytes == 400
    del x_views, y


def test_count_existing_counts_inputs_from_their_first_use() -> None:
    x = torch.ones(100)
    with MemoryTracker(count_existing=True) as tracker:
        assert tracker.live_bytes == 0
        y = x * 2
        assert tracker.live_bytes == 800
    del y


def test_track_adds_existing_tensors_under_a_category() -> None:
    input_ids = torch.zeros(2, 50, dtype=torch.int64)
    with MemoryTracker() as tracker:
        tracker.track([input_ids, input_ids[0]], CHECKPOINTS)
        assert tracker.result().end_breakdown_bytes == _zeros(checkpoints=2 * 50 * 8)


def test_torch_tensor_data_and_in_place_resize_are_counted() -> None:
    with MemoryTracker() as tracker:
        a = torch.tensor([1.0, 2.0, 3.0])
        assert tracker.live_bytes == 12
        b = torch.empty(3).resize_(100)
        assert tracker.live_bytes == 12 + 400
    del a, b


def test_storages_resized_outside_any_op_count_from_the_next_op_when_tracked_resizable() -> None:
    """FSDP2 frees and re-allocates its gathered parameters with `UntypedStorage.resize_`, which no
    dispatch mode sees; a resizable storage's size is re-read before every op."""
    gathered = torch.empty(100)
    gathered.untyped_storage().resize_(0)
    with MemoryTracker() as tracker:
        tracker.track_resizable([gathered], WEIGHTS)
        assert tracker.live_bytes == 0
        gathered.untyped_storage().resize_(100 * F32)  # an all-gather's copy-out
        scratch = torch.ones(10)  # the next op reads the new size before its own output
        assert tracker.result().end_breakdown_bytes == _zeros(weights=100 * F32, temporaries=10 * F32)
        gathered.untyped_storage().resize_(0)  # reshard
        scratch.add_(1)
        assert tracker.live_bytes == 10 * F32
        assert tracker.peak_bytes == 110 * F32


def test_device_filter_counts_only_that_device() -> None:
    with MemoryTracker(device="meta") as tracker:
        on_cpu = torch.empty(1000)
        on_meta = torch.empty(10, device="meta")
    assert (tracker.result().end_bytes, tracker.result().device) == (40, "meta")
    with MemoryTracker() as tracker:
        on_cpu2 = torch.empty(1000)
        on_meta2 = torch.empty(10, device="meta")
    assert (tracker.result().end_bytes, tracker.result().device) == (4040, "cpu,meta")
    del on_cpu, on_meta, on_cpu2, on_meta2


def test_fake_tensors_are_tracked() -> None:
    with FakeTensorMode(), MemoryTracker() as tracker:
        a = torch.empty(1000)
        b = a[:10] * 2
        del a
    assert (tracker.result().peak_bytes, tracker.result().end_bytes) == (4040, 40)
    del b


def test_reset_peak_measures_from_now() -> None:
    with MemoryTracker() as tracker:
        big = torch.empty(1000)
        del big
        kept = torch.empty(100)
        assert tracker.peak_bytes == 4000
        tracker.reset_peak()
        assert tracker.peak_bytes == 400
        tmp = torch.empty(50)
        del tmp
    assert tracker.result().peak_bytes == 600
    del kept


def test_activation_peak_is_the_latest_point_with_the_most_bytes_outside_the_state() -> None:
    """Logits-like temporaries, then gradients beside them (a tie in activations: the later point, with
    the gradients, is kept), then more gradients once they are gone: the device peak is there, at the end,
    and the activation peak where the temporaries were, with the first gradients and not the rest."""
    with MemoryTracker() as tracker:
        tracker.reset_peak()
        with memory_category(TEMPORARIES):
            logits = torch.empty(1000)
        with memory_category(GRADS):
            first = torch.empty(100)
        del logits
        with memory_category(GRADS):
            rest = torch.empty(2000)
        with memory_category(TEMPORARIES):
            small = torch.empty(10)
        del small
    result = tracker.result()
    assert result.peak_breakdown_bytes == _zeros(grads=2100 * F32, temporaries=10 * F32)
    assert result.activation_peak_breakdown_bytes == _zeros(grads=100 * F32, temporaries=1000 * F32)
    del first, rest


def test_result_is_frozen_at_exit() -> None:
    with MemoryTracker() as tracker:
        a = torch.empty(100)
    del a
    torch.empty(1000)  # made and freed after exit: a tracker still counting would peak at 4000 and end at 0
    assert (tracker.result().peak_bytes, tracker.result().end_bytes) == (400, 400)


def test_nested_trackers_both_count() -> None:
    with MemoryTracker() as outer:
        a = torch.empty(100)
        with MemoryTracker() as inner:
            b = torch.empty(10)
    assert (outer.result().end_bytes, inner.result().end_bytes) == (440, 40)
    del a, b


@torch.library.custom_op("streambp_test::double_with_scratch", mutates_args=())
def _double_with_scratch(x: torch.Tensor) -> torch.Tensor:
    scratch = torch.empty(10_000, device=x.device)  # invisible to the tracker: inside the op
    del scratch
    return x * 2


@_double_with_scratch.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    scratch = torch.empty(10_000, device=x.device)
    del scratch
    return torch.empty_like(x)


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_counts_its_outputs_only(device: str) -> None:
    x = torch.ones(25, device=device)
    with MemoryTracker() as tracker:
        y = _double_with_scratch(x)
    assert tracker.result().peak_bytes == 100
    del y


# --- parameters, gradients, optimizer -------------------------------------------------------------------

IN, HIDDEN, OUT, BATCH = 8, 32, 4, 64
W1, B1, W2, B2 = HIDDEN * IN * F32, HIDDEN * F32, OUT * HIDDEN * F32, OUT * F32
WEIGHT_BYTES = W1 + B1 + W2 + B2
ACT = BATCH * HIDDEN * F32  # one (BATCH, HIDDEN) activation or activation gradient
SCALAR = F32


def _mlp(device: str) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    return model.to(device), torch.randn(BATCH, IN, device=device)


def _step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with memory_category(CHECKPOINTS):
        loss = model(x).sum()
    loss.backward()
    return loss


@pytest.mark.parametrize("device", DEVICES)
def test_backward_peak_and_breakdown_with_fresh_grads(device: str) -> None:
    """Peak is inside ReLU's backward, after the second Linear's grads were accumulated.

    Forward keeps the ReLU output r (ACT) and the loss; the first Linear's output dies at the ReLU.
    Backward: ones_like(loss); Linear2 gives grad_r (ACT) and its weight/bias grads (stolen into .grad);
    ReLU's backward makes grad_h (ACT) while r and grad_r are alive: 3 ACT + 2 scalars + W + grads of
    Linear2. Linear1's grads come after r and grad_r are freed.
    """
    model, x = _mlp(device)
    with MemoryTracker(model) as tracker:
        loss = _step(model, x)
    result = tracker.result()
    assert result.peak_bytes == WEIGHT_BYTES + (W2 + B2) + 3 * ACT + 2 * SCALAR
    assert result.peak_breakdown_bytes == _zeros(
        weights=WEIGHT_BYTES, grads=W2 + B2, checkpoints=ACT + SCALAR, temporaries=2 * ACT + SCALAR
    )
    assert result.end_breakdown_bytes == _zeros(weights=WEIGHT_BYTES, grads=WEIGHT_BYTES, checkpoints=SCALAR)
    del loss


@pytest.mark.parametrize("device", DEVICES)
def test_backward_peak_with_resident_grads(device: str) -> None:
    """With grads allocated before entry (an accumulation micro-step) they count from the start and the
    incoming gradients are added in place and freed before ReLU's backward, so the peak holds all grads."""
    model, x = _mlp(device)
    _step(model, x)
    with MemoryTracker(model) as tracker:
        loss = _step(model, x)
    result = tracker.result()
    assert result.peak_bytes == 2 * WEIGHT_BYTES + 3 * ACT + 2 * SCALAR
    assert result.peak_breakdown_bytes == _zeros(
        weights=WEIGHT_BYTES, grads=WEIGHT_BYTES, checkpoints=ACT + SCALAR, temporaries=2 * ACT + SCALAR
    )
    assert result.end_bytes == 2 * WEIGHT_BYTES + SCALAR
    del loss


def test_grads_made_without_a_model_stay_temporaries() -> None:
    model, x = _mlp("meta")
    with MemoryTracker() as tracker:
        loss = model(x).sum()
        loss.backward()
    assert tracker.result().end_breakdown_bytes == _zeros(temporaries=WEIGHT_BYTES + SCALAR)
    del loss


def test_zero_grad_set_to_none_frees_grads() -> None:
    model, x = _mlp("cpu")
    _step(model, x)
    with MemoryTracker(model) as tracker:
        model.zero_grad(set_to_none=True)
    result = tracker.result()
    assert (result.peak_bytes, result.end_breakdown_bytes) == (2 * WEIGHT_BYTES, _zeros(weights=WEIGHT_BYTES))


def _adam_state_bytes(model: torch.nn.Module) -> int:
    """exp_avg and exp_avg_sq per parameter element, plus one float32 `step` scalar per parameter."""
    params = list(model.parameters())
    return sum(2 * p.numel() * F32 + SCALAR for p in params)


def test_optimizer_state_made_in_step_is_optimizer() -> None:
    model, x = _mlp("cpu")
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)
    with MemoryTracker(model, optimizer) as tracker:
        loss = _step(model, x)
        optimizer.step()
        assert current_category() == TEMPORARIES
    assert tracker.result().end_breakdown_bytes == _zeros(
        weights=WEIGHT_BYTES, grads=WEIGHT_BYTES, optimizer=_adam_state_bytes(model), checkpoints=SCALAR
    )
    del loss


def test_existing_optimizer_state_counts_from_entry() -> None:
    model, x = _mlp("cpu")
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)
    _step(model, x)
    optimizer.step()
    with MemoryTracker(model, optimizer) as tracker:
        pass
    assert tracker.result().peak_breakdown_bytes == _zeros(
        weights=WEIGHT_BYTES, grads=WEIGHT_BYTES, optimizer=_adam_state_bytes(model)
    )


def test_hooks_are_removed_at_exit() -> None:
    model, x = _mlp("cpu")
    optimizer = torch.optim.SGD(model.parameters())
    with MemoryTracker(model, optimizer):
        pass
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_tied_parameters_count_once() -> None:
    embed = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    with MemoryTracker(torch.nn.ModuleList([embed, head])) as tracker:
        pass
    assert tracker.result().end_breakdown_bytes == _zeros(weights=10 * 4 * F32)


# --- results and breakdowns --------------------------------------------------------------------------


def test_breakdown_from_result_in_gib() -> None:
    with MemoryTracker() as tracker:
        with memory_category(WEIGHTS):
            w = torch.empty(GIB // 4 // 1024, device="meta")  # 1 MiB
        with memory_category(GRADS):
            g = torch.empty(GIB // 4 // 512, device="meta")  # 2 MiB
        with memory_category(OPTIMIZER):
            o = torch.empty(GIB // 4 // 256, device="meta")  # 4 MiB
    result = tracker.result()
    assert result.peak_gib == pytest.approx(7 / 1024)
    by_category = result.peak_breakdown_gib
    assert (by_category["weights"], by_category["grads"], by_category["optimizer"]) == (1 / 1024, 2 / 1024,
                                                                                        4 / 1024)
    assert list(by_category) == list(CATEGORIES)
    del w, g, o
