"""The forwards a prepared model answers a trainer with, set on the model instance and undone by `close`.

A trainer reaches the model through two calls, and each gets a streamed answer:

- the decoder stack (`model.model`): TRL 1.15+ computes per-token log-probs with its own fused LM head on
  top of `backbone(input_ids, attention_mask, use_cache=False)`; the streamed stack returns the same
  `last_hidden_state` through StreamBP's layers, so TRL's losses (SFT, DPO, GRPO, every loss type) run
  unchanged on it and never see full logits;
- the causal LM (`model(..., labels=...)`, transformers' `Trainer`): the loss through the streamed head,
  `run.loss`, with transformers' normalisation (`num_items_in_batch` when given).

Every other call (generation with a KV cache, logits for evaluation) goes to the forward that was there
before. Autocast is off inside the streamed parts, so their backward recomputes exactly what their
forward computed; `stream_trainer` refuses autocast over float32/float64 weights (see `checks.py`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from streambp_core.config import ConfigError
from streambp_core.engine.packing import PACKING_ARGUMENTS, call_position_ids
from streambp_core.engine.stream.objectives import IGNORE_INDEX

HARMLESS_ARGUMENTS = frozenset({"return_dict", "cache_position"})
"""Arguments a streamed forward accepts whatever their value (they change nothing it returns)."""
CACHE_ARGUMENTS = ("past_key_values", "cache")
"""The KV cache argument's names (transformers renamed `past_key_values` to `cache`)."""


def set_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """Set `forward` as this instance's forward (the class keeps its own); return the undo.

    The wrapper keeps the class forward's signature, which transformers' `generate` and `Trainer` inspect.
    """
    had_own = "forward" in vars(module)
    previous = vars(module).get("forward")
    bound = types.MethodType(functools.wraps(type(module).forward)(forward), module)
    module.forward = bound

    def undo() -> None:
        if vars(module).get("forward") is not bound:
            name = type(module).__name__
            raise RuntimeError(f"{name}.forward was replaced after streambp set it; left as it is")
        if had_own:
            module.forward = previous
        else:
            del module.forward

    return undo


def streamed_backbone_forward(run, previous: Callable[..., Any],
                              head: HeadUnit | None = None) -> Callable[..., Any]:
    """A decoder-stack forward that streams training-shaped calls through `run.hidden_states`; under
    DeepSpeed ZeRO-3, `head` gathers the run's head unit before the final norm (`HeadUnit`)."""

    def forward(self, *args, **kwargs):
        call = call_arguments(self, args, kwargs)
        reason = not_streamable(call)
        if reason is None:
            input_ids = call["input_ids"]
            with torch.autocast(input_ids.device.type, enabled=False), _no_new_external_params(self):
                hidden = run.hidden_states(input_ids, call.get("attention_mask"), call_position_ids(call))
                if head is not None:
                    hidden = head.enter(hidden)
                # The final norm recomputed in backward: only the layer output is kept for it.
                hidden = checkpoint(run.parts.norm, hidden, use_reentrant=False)
            return BaseModelOutputWithPast(last_hidden_state=hidden)
        if torch.is_grad_enabled() and not generating(call):
            raise ConfigError(f"a {run.method} model cannot train on a forward with {reason}")
        return previous(*args, **kwargs)

    return forward


def streamed_loss_forward(run, previous: Callable[..., Any],
                          arm: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Callable[..., Any]:
    """A causal-LM forward that answers `model(input_ids, attention_mask, labels)` with `run.loss`.

    With `num_items_in_batch` (transformers' `Trainer` under gradient accumulation) the loss is the token
    sum over that count, as transformers' own causal-LM loss is; without it, the mean over this batch.
    `arm` (under DeepSpeed) is given the loss, to defer ZeRO's reductions to one per parameter.
    """

    def forward(self, *args, **kwargs):
        call = call_arguments(self, args, kwargs)
        if call.get("labels") is None or call.get("fused_lm_head"):
            return previous(*args, **kwargs)
        labels, num_items = call.pop("labels"), call.pop("num_items_in_batch", None)
        call.pop("logits_to_keep", None)
        call["use_cache"] = False  # nothing is cached on this path, whatever the config says
        reason = not_streamable(call)
        if reason is not None:
            raise ConfigError(f"a {run.method} model cannot compute its loss on a forward with {reason}")
        input_ids = call["input_ids"]
        with torch.autocast(input_ids.device.type, enabled=False), _no_new_external_params(self):
            loss = run.loss(input_ids, attention_mask=call.get("attention_mask"), labels=labels,
                            position_ids=call_position_ids(call))
        if arm is not None:
            loss = arm(loss)
        if num_items is not None:
            num_valid = (labels[:, 1:] != IGNORE_INDEX).sum().to(loss.dtype)
            loss = loss * num_valid / torch.as_tensor(num_items, device=loss.device, dtype=loss.dtype)
        return CausalLMOutputWithPast(loss=loss)

    return forward


@contextlib.contextmanager
def _no_new_external_params(module: nn.Module):
    """Under DeepSpeed ZeRO-3, undo the "external parameters" DeepSpeed registers on `module` while its
    forward runs: a partitioned parameter of another module read by attribute there (the run's checks
    read the embedding's and the head's shapes; its units read their weights) is gathered and made
    `module`'s own, so `module`'s backward would gather it again and hold it while the run's unit
    releases it. The run gathers and releases its units itself (`engine.engines.zero3`); nothing without
    ZeRO-3."""
    external = getattr(module, "_external_params", None)
    before = set(external or ())
    try:
        yield
    finally:
        added = [param for key, param in (external or {}).items() if key not in before]
        if added:
            from deepspeed.runtime.zero.partition_parameters import unregister_external_parameter

            for param in added:
                unregister_external_parameter(module, param)


class HeadUnit:
    """Under DeepSpeed ZeRO-3, the run's head unit [final norm, LM head] (`engine.engines.zero3`) held
    gathered from
    the final norm (`enter`, in the streamed decoder stack's forward) to the end of the causal LM's forward
    (`hook_output`, a forward hook), where the trainer's own fused head (TRL's) has read the LM head's
    weight. DeepSpeed's hooks no longer gather the unit's modules; gathered, the head's weight is not
    made an "external parameter" of the causal LM, which DeepSpeed's backward would hold while the unit
    releases it. Its gradients go to ZeRO once, when the unit's backward ends (after the trainer's head
    and the norm have both accumulated into them)."""

    def __init__(self, run) -> None:
        self.units = run.zero3
        self.index = self.units.num_units - 1
        self._open = False

    def enter(self, hidden: torch.Tensor) -> torch.Tensor:
        """Gather the unit; `hidden` (the final norm's input) comes back bracketed (`Zero3Units.enter`)."""
        self._open = True
        return self.units.enter(self.index, hidden)

    def hook_output(self, module: nn.Module, args, output):
        """A forward hook of the causal LM: release the unit entered in this forward; the output's tensors
        that need a gradient come back bracketed, to gather the unit again before its backward."""
        if not self._open:
            return None
        self._open = False
        keys = [key for key, value in output.items()
                if isinstance(value, torch.Tensor) and value.requires_grad]
        if not keys:
            self.units.leave(self.index, None)
        for key in keys:
            output[key] = self.units.leave(self.index, output[key])
        return output


def call_arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name (positional ones named by the class forward's signature)."""
    if not args:
        return dict(kwargs)
    names = [n for n in inspect.signature(type(module).forward).parameters if n != "self"]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def generating(call: dict) -> bool:
    """Whether the call reads or fills a KV cache (generation): such calls keep the model's own forward."""
    return bool(call.get("use_cache")) or any(call.get(name) is not None for name in CACHE_ARGUMENTS)


def not_streamable(call: dict) -> str | None:
    """Why this forward call cannot be streamed (a phrase naming the argument), or None when it can."""
    input_ids, attention_mask = call.get("input_ids"), call.get("attention_mask")
    if generating(call):
        return "a KV cache (use_cache=True)"
    if call.get("inputs_embeds") is not None or input_ids is None:
        return "inputs_embeds instead of input_ids"
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        return f"input_ids of shape {tuple(input_ids.shape)} (need batch x seq_len, seq_len >= 2)"
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        return "an attention_mask that is not one 0/1 entry per token"
    handled = {"input_ids", "attention_mask", "position_ids", "inputs_embeds", "use_cache", *CACHE_ARGUMENTS,
               *PACKING_ARGUMENTS}
    extra = sorted(k for k, v in call.items()
                   if k not in handled | HARMLESS_ARGUMENTS and v is not None and v is not False)
    if extra:
        return ", ".join(extra)
    return None
