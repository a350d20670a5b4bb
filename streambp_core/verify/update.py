"""One verification step with AdamW (`VerifySpec` whose step has `optimizer="adamw"`): the gradients as the
optimizer receives them and the update it applies, so the host tiers (`optimizer`: AdamW stepped in host
memory; `params`: the weights in host memory) are checked like every method.

Steps of `adamw_step`:
1. Keep a copy of every trainable weight.
2. Prepare the method with the step's tiers, make its AdamW (`Run.adamw`: `HostAdamW` with the optimizer
   tier, else torch's on the device), run forward and backward.
3. Read each gradient where the optimizer will take it: `.grad`, or with the optimizer tier the host copies
   `HostAdamW.host_gradient` sums exactly as its step does.
4. Step, close the run (which takes `HostAdamW`'s hooks off), and take update = weight after - weight
   before; put the weights back, so the next method starts from the same ones.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

import streambp_core
from streambp_core.config import StepSpec
from streambp_core.engine.host.optimizer import HostAdamW
from streambp_core.step.parts.batch import Batch, objective_inputs
from streambp_core.verify.compare import Gradients

VERIFY_LR = 1e-3
"""AdamW's learning rate in a verification (its other hyperparameters are torch's defaults)."""


def adamw_step(model: PreTrainedModel, step: StepSpec, batch: Batch) -> tuple[Tensor, Gradients, Gradients]:
    """(loss, gradients, applied update) of one AdamW step of `step` (steps in the module docstring); the
    model's weights are left as they were."""
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    before = {name: p.detach().clone() for name, p in trainable.items()}
    for param in model.parameters():
        param.grad = None
    labels, inputs = objective_inputs(step.objective, batch, step.seed)
    with streambp_core.prepare(model, step.method, step.stream) as run:
        optimizer = run.adamw(lr=VERIFY_LR)  # closing the run takes a HostAdamW's hooks off
        loss = run.loss(batch.input_ids, attention_mask=batch.attention_mask, labels=labels,
                        position_ids=batch.position_ids, **inputs)
        loss.backward()
        grads = {name: _gradient(optimizer, p) for name, p in trainable.items()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        updates = {name: p.detach() - before[name] for name, p in trainable.items()}
        for name, param in trainable.items():
            param.copy_(before[name])
    return loss.detach(), grads, updates


def _gradient(optimizer: torch.optim.Optimizer, param: Tensor) -> Tensor:
    """`param`'s gradient as `optimizer` will apply it (zeros when it has none: no token reached it)."""
    grad = optimizer.host_gradient(param) if isinstance(optimizer, HostAdamW) else param.grad
    return torch.zeros_like(param) if grad is None else grad.detach().clone()
