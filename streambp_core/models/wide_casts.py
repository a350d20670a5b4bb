"""`WideFloat32Casts`: float32 casts that keep a float64 tensor float64, under which a float64 model's float32
islands (`models.precision`, `models.precision_v4`) run transformers' own code in float64."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode


class WideFloat32Casts(TorchFunctionMode):
    """Inside it, `t.float()`, `t.to(torch.float32, ...)` and an op's `dtype=torch.float32` (DeepSeek-V4's
    `softmax(..., dtype=torch.float32)`) on a float64 tensor t keep float64; every other op (and every
    other cast) runs as it is. No effect on float32, float16 and bfloat16 tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], Tensor) and args[0].dtype == torch.float64:
            if func is Tensor.float:
                return args[0]
            if func is Tensor.to:
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


def forward_under_wide_casts(self, *args, **kwargs):
    """transformers' forward of the module's class, under `WideFloat32Casts` (an instance's forward, bound
    with `types.MethodType`, in a float64 model)."""
    with WideFloat32Casts():
        return type(self).forward(self, *args, **kwargs)
