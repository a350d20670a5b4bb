"""Backward steps of a layer's linear pieces taken by hand, so a streamed layer's backward multiplies no
more matrices than checkpointing does, and dispatches fewer ops.

- K/V projections: the accumulated dK/dV of a chunk go back through RoPE's transpose (a rotation by the
  opposite angle), the k-norm's backward (autograd, from the pre-norm keys the cache pass kept) and the
  projections' backward (dW += dY^T x, dx = dY W) without projecting the chunk a third time.
- Gated MLP (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`, the form of every supported dense family;
  Phi-3's gate and up are the halves of one `gate_up_proj`): the
  chunk's graph stops at the down projection's input; the down projection's backward is taken by hand,
  so its forward (whose output only feeds the gradient's residual sum) is not recomputed, as torch's
  non-reentrant checkpoint skips it too.
- Every other projection of a chunk's recomputed graph (q, o, gate, up; `hand_linear`): autograd's linear
  backward with the weight gradient added to `.grad` in place (one GEMM that accumulates, no weight-sized
  temporary per chunk, four ops fewer per projection).

Each applies only to plain `nn.Linear` projections, or rows of one (`FusedRows`: Phi-3's q, k and v);
a wrapped one (peft LoRA) keeps the autograd path. Weight gradients accumulate in `.grad` in place, as
`backward_into` does (a fused projection's rows in their rows of its `.grad`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from streambp_core.engine.chunks import backward_into, leaf
from streambp_core.engine.stream.rope import Rope, rope_transpose
from streambp_core.measure.tags import GRADS, memory_category
from streambp_core.models.adapters import GATED_MLP_CLASSES, FusedRows


def plain_linear(module) -> bool:
    """Whether `module` is a bare `nn.Linear` (bias or not), or rows of one (`FusedRows`), whose backward
    this module takes by hand."""
    if isinstance(module, FusedRows):
        module = module.fused
    return type(module) is nn.Linear


def gated_mlp(mlp: nn.Module) -> bool:
    """Whether `mlp` is a known gated MLP with a plain down projection."""
    return type(mlp).__name__ in GATED_MLP_CLASSES and plain_linear(mlp.down_proj)


def linear_backward(module: nn.Linear, x: Tensor, grad_y: Tensor) -> Tensor:
    """dL/dx of y = module(x) for dL/dy = grad_y (both (..., features)); dW and db accumulate in `.grad`."""
    with torch.no_grad():
        return _linear_backward(module, x.flatten(0, -2), grad_y.flatten(0, -2)).view(
            *grad_y.shape[:-1], module.weight.shape[1])


def _linear_backward(module: nn.Linear | FusedRows, x_2d: Tensor, grad_2d: Tensor) -> Tensor:
    weight, bias, rows = _parameters(module)
    if weight.requires_grad:
        _accumulate_mm(weight, rows, grad_2d.t(), x_2d)
    if bias is not None and bias.requires_grad:
        if bias.grad is None and rows == slice(None):
            with memory_category(GRADS):
                bias.grad = grad_2d.sum(dim=0)
        else:
            _grad_of(bias)[rows].add_(grad_2d.sum(dim=0))
    return grad_2d @ weight[rows]


def _parameters(module: nn.Linear | FusedRows) -> tuple[Tensor, Tensor | None, slice]:
    """The weight and bias parameters a projection reads, and which of their rows (all, or a
    `FusedRows`'s)."""
    if isinstance(module, FusedRows):
        return module.fused.weight, module.fused.bias, slice(module.start, module.end)
    return module.weight, module.bias, slice(None)


def _grad_of(param: Tensor) -> Tensor:
    """`param.grad`, zeros when it has none yet (rows of it are about to be added to)."""
    if param.grad is None:
        with memory_category(GRADS):  # the tracker's accumulate-grad hook does not see a `.grad` set here
            param.grad = torch.zeros_like(param)
    return param.grad


def _accumulate_mm(param: Tensor, rows: slice, a: Tensor, b: Tensor) -> None:
    if param.grad is None and rows == slice(None):
        with memory_category(GRADS):  # the tracker's accumulate-grad hook does not see a `.grad` set here
            param.grad = a @ b
    else:
        _grad_of(param)[rows].addmm_(a, b)


class _HandLinear(torch.autograd.Function):
    """autograd.Function: y = module(x) for a plain nn.Linear; backward: dx = dY W, dW (and db) added to
    `.grad` in place (`linear_backward`). The weight is not an input: its gradient never goes through
    autograd, as in the K/V and down projections."""

    @staticmethod
    def forward(ctx, x: Tensor, module: nn.Linear) -> Tensor:
        ctx.module = module
        ctx.save_for_backward(x)
        return torch.nn.functional.linear(x, module.weight, module.bias)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        (x,) = ctx.saved_tensors
        return linear_backward(ctx.module, x, grad_y), None


def hand_linear(module: nn.Module, x: Tensor) -> Tensor:
    """module(x); under grad, for a plain nn.Linear whose input takes a gradient, with the backward of
    `_HandLinear` (any other module or case: the module under autograd)."""
    if plain_linear(module) and x.requires_grad and torch.is_grad_enabled():
        return _HandLinear.apply(x, module)
    return module(x)


def mlp_inner(mlp: nn.Module, x: Tensor) -> Tensor:
    """act_fn(gate_proj(x)) * up_proj(x): a gated MLP up to its down projection's input (Phi-3's: the
    halves gate, up of gate_up_proj(x), as up * activation_fn(gate))."""
    if hasattr(mlp, "gate_up_proj"):
        gate, up = hand_linear(mlp.gate_up_proj, x).chunk(2, dim=-1)
        return up * mlp.activation_fn(gate)
    return mlp.act_fn(hand_linear(mlp.gate_proj, x)) * hand_linear(mlp.up_proj, x)


def kv_projection_backward(parts, x: Tensor, raw_keys: Tensor | None, d_keys: Tensor, d_values: Tensor,
                           rope: Rope, params) -> Tensor:
    """dL/dx (B, c, d) through a chunk's k/v projections from its complete dK, dV (B, Hkv, c, hd).

    `x` is the chunk's normed input; `raw_keys` (B, c, Hkv, hd) its keys before the k-norm, needed only
    when the layer has one (for a k-norm after RoPE, HunYuan's, the rotated keys).
    """
    if parts.k_norm is not None and parts.qk_norm_after_rope:
        d_rotated = _k_norm_backward(parts, raw_keys, d_keys.transpose(1, 2), params)
        d_k = rope_transpose(d_rotated.transpose(1, 2), rope).transpose(1, 2)
    else:
        d_k = rope_transpose(d_keys, rope).transpose(1, 2)  # (B, c, Hkv, hd), after the k-norm
        if parts.k_norm is not None:
            d_k = _k_norm_backward(parts, raw_keys, d_k, params)
    grad_x = linear_backward(parts.k_proj, x, d_k.flatten(2))
    return grad_x.add_(linear_backward(parts.v_proj, x, d_values.transpose(1, 2).flatten(2)))


def _k_norm_backward(parts, raw_keys: Tensor, d_normed: Tensor, params) -> Tensor:
    """dL/d(raw_keys) (B, c, Hkv, hd) through the k-norm for dL/d(k_norm(raw_keys)) = d_normed; the
    norm's weight gradient accumulates in `.grad`."""
    raw = leaf(raw_keys)
    with torch.enable_grad():
        normed = parts.norm_heads(parts.k_norm, raw)
    backward_into([normed], [d_normed], [raw], params)
    return raw.grad


def down_projection_backward(mlp: nn.Module, inner: Tensor, grad_out: Tensor) -> Tensor:
    """dL/d(inner) of out = down_proj(inner) for dL/dout = grad_out; the down projection's `.grad` too."""
    return linear_backward(mlp.down_proj, inner.detach(), grad_out).view_as(inner)
