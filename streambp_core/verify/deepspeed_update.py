"""The applied update of a DeepSpeed verify against single-process plain's step, and the rows each rank
feeds it.

An update is judged against plain's only where the optimizer is linear in the gradient (SGD): its step is
`-lr * g`, so an engine whose gradient is plain's up to `GRAD_TOLERANCE` applies plain's step up to the
same share, plus float32's rounding of the write. That rounding is not small beside the update: ZeRO
writes `fl32(p - lr * g)` into float32 masters, whose grid at |p| ~ 1 (a norm's weight) is 1.2e-7 apart,
so a step of lr * g ~ 1e-6 lands up to a tenth of itself away from the exact one, and two gradients that
differ in their seventh digit can land one grid point apart. Measured on the user's loop (tiny Llama,
untied, vocabulary 211, T 53, SGD lr 1e-4, float32, 2 ranks): every method's reduced gradient within
4.7e-7 of plain's and its update exactly SGD's step on it, yet the update 1.2e-4 from plain's float32
step, while plain's own float32 step is 0.88 from the exact one at the worst parameter. So the bound is
float32's own: per parameter p,

    ||u - u_plain|| <= 2 ||u_plain - u_exact|| + GRAD_TOLERANCE (||u_exact|| + sqrt(n_p) rms),

`u_plain` plain's step from float32 masters (the rounding the engine's own write also makes, at most twice
over for two writes), `u_exact` the same step in float64, `rms` the RMS of `u_exact` over all parameters
(the gradient criterion's absolute part, `compare.max_grad_err`). `update_ratio` is the left side over the
right, worst parameter; a gradient reduced twice or before its last firing puts it far above 1.
"""

from __future__ import annotations

import math

import torch

from streambp_core.config import ConfigError
from streambp_core.step.parts.batch import Batch

OPTIMIZERS = ("adam", "sgd")
"""The optimizers a DeepSpeed verify steps: torch's Adam from DeepSpeed's config, or a client SGD."""

LINEAR = ("sgd",)
"""The optimizers whose update is judged against plain's (module docstring); Adam's is only reported."""


def check_optimizer(name: str) -> str:
    """`name` when it is one of `OPTIMIZERS`; ConfigError otherwise."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"deepspeed verify optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    return name


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """torch's class of optimizer `name`."""
    return {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[check_optimizer(name)]


def rank_padded(batch: Batch, rank: int, padding: str) -> Batch:
    """`batch` with rank `rank`'s rows padded `rank * (T // 8 + 1)` positions more on the `padding` side
    ("right" or "left"; at least two real tokens left a row): each rank counts a different number of
    valid tokens, as a real loader's ranks do, so each rank's mean loss has its own denominator. Unpadded
    batches stay."""
    mask = batch.attention_mask
    if mask is None or rank == 0:
        return batch
    seq_len = mask.shape[1]
    valid = (mask.sum(dim=1) - rank * (seq_len // 8 + 1)).clamp(min=2)  # (B,)
    positions = torch.arange(seq_len, device=mask.device)[None]
    real = positions < valid[:, None] if padding == "right" else positions >= seq_len - valid[:, None]
    new_mask = real.to(mask.dtype)
    return Batch(input_ids=batch.input_ids.masked_fill(~real, 0), attention_mask=new_mask,
                 labels=batch.labels.masked_fill(~real, -100))


def update_ratio(update: dict[str, torch.Tensor], plain: dict[str, torch.Tensor],
                 exact: dict[str, torch.Tensor], grad_tolerance: float) -> tuple[float, str]:
    """The worst parameter's ||u - u_plain|| over float32's allowance (module docstring), and its name."""
    sizes = {name: exact[name].numel() for name in exact}
    total = sum(sizes.values())
    rms = math.sqrt(sum(float(u.double().square().sum()) for u in exact.values()) / total) if total else 0.0
    worst, worst_name = 0.0, ""
    for name, u_exact in exact.items():
        u_exact = u_exact.double()
        u_plain = plain[name].double()
        off = float((update[name].double() - u_plain).norm())
        allowance = 2 * float((u_plain - u_exact).norm()) + grad_tolerance * (
            float(u_exact.norm()) + math.sqrt(sizes[name]) * rms)
        ratio = off / allowance if allowance > 0 else (0.0 if off == 0 else math.inf)
        if ratio > worst or math.isnan(ratio) or not worst_name:
            worst, worst_name = ratio, name
    return worst, worst_name
