"""The shallow depths a simulation extrapolates from: whole periods of the model's layer pattern.

A decoder's layers may differ by position, as the config says per layer index (`layer_kinds`): its
`layer_types` entry (sliding, chunked, full or linear attention), its `no_rope_layers` entry (NoPE
layers), whether it is one of `moe_layers` or `mlp_only_layers`, a sparse layer of
`decoder_sparse_step` (with experts) and whether it is one of the first `first_k_dense_replace` dense
layers. Read in order, the kinds are a prefix of k layers, then a pattern of period P repeated n times,
then the first r layers of the pattern once more (r < P). Gemma 2: k 0, P 2 (sliding, full);
Qwen3.5: P 4 (3 linear, 1 full); Llama-4-Maverick: P 4 (MoE every 2nd layer, NoPE every 4th);
DeepSeek-V3: k 3 dense layers, then P 1 (MoE); a uniform model: k 0, P 1.

A model cut to its first d = k + m * P + r layers (`with_depth`: every per-layer list cut with it, index
sets kept below d) has the same prefix, m whole periods and the same last r layers; a phase's peak is
affine in the number of whole periods (each one adds the same layers in the same order), so it is
extrapolated from m and m + 1 periods to the model's n (`DepthPlan.extend`). m is the least with
d >= `min_layers` (2 for a memory simulation, as before for a uniform model: 2 and 3 layers).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PretrainedConfig

PER_LAYER_LISTS = ("layer_types", "no_rope_layers")
"""Config lists with one entry per layer (transformers reads `config.<name>[layer_idx]`)."""
INDEX_SETS = ("moe_layers", "mlp_only_layers")
"""Config lists of layer indices (transformers asks `layer_idx in config.<name>`)."""


@dataclass(frozen=True)
class DepthPlan:
    """Two shallow depths of the same layer pattern and the full depth they extrapolate to."""

    num_layers: int
    """Decoder layers of the model."""
    shallow: int
    """Layers of the shallower simulated model (prefix, m whole periods, the cut period)."""
    period: int
    """Layers of one period of the pattern: the deeper simulated model has `shallow + period`."""

    @property
    def depths(self) -> tuple[int, int]:
        """The two depths simulated."""
        return self.shallow, self.shallow + self.period

    @property
    def periods_to_add(self) -> int:
        """Whole periods between the shallower model and the full depth."""
        return (self.num_layers - self.shallow) // self.period

    def extend(self, at_shallow: int, at_deep: int) -> int:
        """A figure affine in whole periods, at full depth from its values at the two depths."""
        return at_shallow + self.periods_to_add * (at_deep - at_shallow)


def layer_kinds(config: PretrainedConfig) -> list[tuple] | None:
    """Per layer index, everything the config says about that layer alone (module docstring); None when
    the config has a per-layer list this module does not know (the depth cannot be cut safely)."""
    total = config.num_hidden_layers
    known = set(PER_LAYER_LISTS) | set(INDEX_SETS)
    for name, value in vars(config).items():
        if name not in known and isinstance(value, list | tuple) and len(value) == total:
            return None
    lists = [list(value) for value in _lists(config, PER_LAYER_LISTS)]
    sets = [set(value) for value in _lists(config, INDEX_SETS)]
    dense_first = getattr(config, "first_k_dense_replace", None) or 0
    sparse_step = getattr(config, "decoder_sparse_step", None) or 1
    experts = (getattr(config, "num_experts", None) or 0) > 0

    def kind(i: int) -> tuple:
        sparse = experts and (i + 1) % sparse_step == 0
        return (*(values[i] for values in lists), *(i in chosen for chosen in sets), i < dense_first, sparse)

    return [kind(i) for i in range(total)]


def _lists(config: PretrainedConfig, names: Sequence[str]) -> list[Sequence]:
    """The config's values of `names` that are lists (an unset one is None)."""
    return [value for name in names if isinstance(value := getattr(config, name, None), list | tuple)]


def _prefix_for(kinds: Sequence[tuple], period: int) -> int:
    """The shortest prefix after which `kinds` repeat with `period`."""
    mismatches = [i for i in range(len(kinds) - period) if kinds[i] != kinds[i + period]]
    return mismatches[-1] + 1 if mismatches else 0


def depth_plan(config: PretrainedConfig, min_layers: int = 2) -> DepthPlan | None:
    """The cheapest `DepthPlan` for `config` (fewest layers simulated), or None when simulating every
    layer is as cheap or the layers cannot be told apart safely (`layer_kinds` is None)."""
    kinds = layer_kinds(config)
    total = config.num_hidden_layers
    if kinds is None:
        return None
    best: DepthPlan | None = None
    for period in range(1, total):
        prefix = _prefix_for(kinds, period)
        cut = (total - prefix) % period
        periods = max(1, -(-(min_layers - prefix - cut) // period))
        plan = DepthPlan(num_layers=total, shallow=prefix + periods * period + cut, period=period)
        if plan.depths[1] < total and (best is None or sum(plan.depths) < sum(best.depths)):
            best = plan
    return best


def with_depth(config: PretrainedConfig, num_layers: int) -> PretrainedConfig:
    """A copy of `config` with its first `num_layers` decoder layers: per-layer lists cut to match, index
    sets kept below `num_layers` (`PER_LAYER_LISTS`, `INDEX_SETS`); `config` itself at its own depth."""
    if num_layers == config.num_hidden_layers:
        return config
    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = num_layers
    for name in PER_LAYER_LISTS:
        if isinstance(value := getattr(shallow, name, None), list | tuple):
            setattr(shallow, name, list(value)[:num_layers])
    for name in INDEX_SETS:
        if isinstance(value := getattr(shallow, name, None), list | tuple):
            setattr(shallow, name, [i for i in value if i < num_layers])
    return shallow
