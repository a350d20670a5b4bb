"""A record of the aten ops one training step dispatches: name, FLOPs and bytes moved, per op.

`OpRecorder` is a `TorchDispatchMode`; it works on any device, the meta device included (shapes are all
it reads), so the ops of a step on a 1.7B model at 16k tokens are known on a CPU in about a second.
It is the common input of the CPU proxies of step time (matmul FLOPs, ops dispatched) and of the roofline
estimate in `streambp_core.step.estimate.roofline`.

FLOPs come from torch's own formulas (`torch.utils.flop_counter.flop_registry`, the table
`FlopCounterMode` uses: matmuls, convolutions, torch's attention kernels) plus the engine's prefix
attention (`streambp::prefix_attn_fwd/_bwd`), counted as a flash kernel computes it: the allowed
(lower-right causal) query-key pairs only. `FlopCounterMode` itself cannot be entered around a step whose
autograd functions run modules without grad (its module tracker needs a grad_fn), hence this mode.

Bytes: every tensor an op reads or writes, counted once per op; views and metadata-only ops move nothing
(`moves_data` False) and launch no kernel.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

MATMUL_OPS = frozenset({"aten.mm", "aten.addmm", "aten.addmm_", "aten.bmm", "aten.baddbmm", "aten.baddbmm_"})
ATTENTION_OPS = frozenset({"streambp.prefix_attn_fwd", "streambp.prefix_attn_bwd"})
_NO_DATA = frozenset({
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.t", "aten.transpose", "aten.permute",
    "aten.expand", "aten.slice", "aten.select", "aten.unsqueeze", "aten.squeeze", "aten.as_strided",
    "aten.alias", "aten.detach", "aten.split", "aten.split_with_sizes", "aten.unbind", "aten.empty",
    "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided", "aten.unflatten",
    "aten._reshape_alias", "aten.lift_fresh", "aten.sym_size", "aten.sym_stride", "aten.sym_numel",
    "aten.is_same_size", "aten._local_scalar_dense", "aten.set_",
})


@dataclass(frozen=True)
class OpRecord:
    """One dispatched op: its name (`aten.mm`), FLOPs and bytes read plus written; an attention op
    also its key length (the keys each query block runs over: what sets its kernel's speed)."""

    name: str
    flops: int
    bytes: int
    keys: int = 0

    @property
    def moves_data(self) -> bool:
        """Whether the op launches a kernel (views and allocations without fill do not)."""
        return self.name not in _NO_DATA

    @property
    def kind(self) -> str:
        """'matmul', 'attention' or 'other' (elementwise, reductions, copies)."""
        if self.name in MATMUL_OPS:
            return "matmul"
        return "attention" if self.name in ATTENTION_OPS else "other"


class OpRecorder(TorchDispatchMode):
    """Dispatch mode recording every op of the code run inside it (`with OpRecorder() as rec: ...`)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[OpRecord] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        name = str(packet)
        flops = _flops(packet, name, args, kwargs, out)
        moved = 0 if name in _NO_DATA else _tensor_bytes(args, kwargs, out)
        keys = _key_len(name, args)
        self.records.append(OpRecord(name, int(flops), moved, keys))
        return out

    def matmul_flops(self) -> int:
        """FLOPs of the matrix multiplications (the figure FlopCounterMode reports for a transformer)."""
        return sum(r.flops for r in self.records if r.kind == "matmul")

    def dispatched(self) -> int:
        """Number of aten ops dispatched, views included."""
        return len(self.records)

    def launches(self) -> int:
        """Number of ops that move data (a kernel launch each on a GPU)."""
        return sum(r.moves_data for r in self.records)


def _flops(packet, name: str, args: tuple, kwargs: dict, out) -> float:
    if name.endswith("_") and not name.endswith("__"):  # in place (addmm_): the out-of-place formula
        packet = getattr(torch.ops.aten, name.removeprefix("aten.").removesuffix("_"), packet)
    if packet in flop_registry:
        return flop_registry[packet](*args, **kwargs, out_val=out)
    if name in ATTENTION_OPS:
        return prefix_attention_flops(args[1] if name.endswith("bwd") else args[0], args[2],
                                      backward=name.endswith("bwd"))
    return 0


def _key_len(name: str, args: tuple) -> int:
    """Key length of an attention op: k (B, Hkv, e, hd) is fwd's second argument, bwd's third."""
    if name not in ATTENTION_OPS:
        return 0
    return args[2 if name.endswith("bwd") else 1].shape[2]


def prefix_attention_flops(q: torch.Tensor, k: torch.Tensor, *, backward: bool) -> float:
    """FLOPs of lower-right causal attention of q (B, H, c, hd) against k (B, Hkv, e, hd), as a flash
    kernel computes it: 2 matmuls (4 FLOPs per allowed pair and head dim) forward, 5 in backward."""
    b, h, c, hd = q.shape
    e = k.shape[2]
    pairs = c * e - c * (c - 1) / 2
    return (10 if backward else 4) * b * h * pairs * hd


def _tensor_bytes(args: tuple, kwargs: dict, out) -> int:
    """Bytes of every distinct tensor among an op's arguments and outputs."""
    tensors: dict[int, torch.Tensor] = {}
    _collect_tensors((args, kwargs, out), tensors)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _collect_tensors(value: Any, tensors: dict[int, torch.Tensor]) -> None:
    """Every tensor in `value`, nested in tuples (named ones and torch's return types too), lists and
    dicts, into `tensors` by id: what `tree_flatten` finds in an op's arguments, without its overhead."""
    if isinstance(value, torch.Tensor):
        tensors.setdefault(id(value), value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect_tensors(item, tensors)
    elif isinstance(value, dict):
        for item in value.values():
            _collect_tensors(item, tensors)


def meta_step_ops(config, method: str, seq_len_tokens: int, *, batch_size: int = 1,
                  num_layers: int | None = None, dtype: torch.dtype = torch.bfloat16,
                  **options) -> list[OpRecord]:
    """The ops of one training step (loss and backward) of `method` on meta tensors.

    `config` is a transformers config or a model name (`load_config`); `num_layers` cuts the model to
    that depth; `options` go to `prepare` (partition sizes, objective, head_mode, ...).
    """
    import streambp_core
    from streambp_core.models.load import build_model, load_config

    config = copy.deepcopy(load_config(config) if isinstance(config, str) else config)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    model = build_model(config, dtype=dtype, device="meta")
    ids = torch.zeros(batch_size, seq_len_tokens, dtype=torch.long, device="meta")
    with streambp_core.prepare(model, method, **options) as run, OpRecorder() as recorder:
        run.loss(ids).backward()
    return recorder.records


def spec_step_ops(setup, cache: dict | None = None) -> list[OpRecord]:
    """The ops of one step of a meta `step.run.setup.Setup`: the spec's method, protocol and options, its loss
    and backward, then its optimizer's step when it has one (one rank's, simulated, under sequence
    parallelism: `run.sequence_group`). Meta kernels are memoised
    (`simulation_mode.SimulationMode`, `cache` shared between calls), which changes no op or shape."""
    from streambp_core.methods import prepare
    from streambp_core.step.run.protocol import step_protocol
    from streambp_core.step.run.simulation_mode import SimulationMode
    from streambp_core.step.run.tracked import sequence_group

    spec = setup.spec
    group = sequence_group(spec, "meta")  # one simulated rank of a sequence-parallel step
    with prepare(setup.model, spec.method, spec.stream, sequence_group=group) as run, \
            step_protocol(run, spec.protocol), SimulationMode(None, cache), OpRecorder() as recorder:
        run.loss(**setup.inputs).backward()
        if setup.optimizer is not None:
            setup.optimizer.step()
    return recorder.records
