"""One model config, resolved once: what every step of that model is built and simulated from.

A command resolves each model once (`ResolvedModel.of(name)`: the preset or config.json read and
validated, `models.load_config`) and hands the object to every step, simulation and search of that model.
Model builds trust its config (`models.build_model(..., checked=True)`); the only copies are the config
at other depths (`at_depth`, one per depth, kept) and the depths a simulation extrapolates from (`depth_plan`:
whole periods of its layer pattern). It also owns the simulation memo: the output
metadata of meta kernels (`simulation_mode.SimulationMode`), a sharded step's shard layout, and
`simulate`'s answers, phases and meta models, shared by every simulated step of the model, which changes
no figure, only the time.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from streambp_core.models.load import checked_config
from streambp_core.step.parts.depth import DepthPlan, depth_plan, with_depth


class ResolvedModel:
    """A model's validated config, its depth variants and its simulation memo (module docstring)."""

    def __init__(self, model: str | PretrainedConfig) -> None:
        """`model`: a preset name or local directory (loaded and validated), or a config (validated, then
        copied, so later changes to the caller's object do not reach it)."""
        self.config: PretrainedConfig = checked_config(model)
        self.memo: dict = {}
        """Simulation memo: meta kernels' output metadata and shard layouts
        (`simulation_mode.SimulationMode`)."""
        self._depths: dict[int, PretrainedConfig] = {}

    @classmethod
    def of(cls, model: ResolvedModel | PretrainedConfig | str) -> ResolvedModel:
        """`model` itself when already resolved, else it resolved (`ResolvedModel(model)`)."""
        return model if isinstance(model, ResolvedModel) else cls(model)

    @property
    def num_layers(self) -> int:
        """Decoder layers of the model."""
        return self.config.num_hidden_layers

    def at_depth(self, num_layers: int) -> PretrainedConfig:
        """The config with its first `num_layers` decoder layers (`depth.with_depth`): copied once per
        depth."""
        if num_layers not in self._depths:
            self._depths[num_layers] = with_depth(self.config, num_layers)
        return self._depths[num_layers]

    @property
    def depth_plan(self) -> DepthPlan | None:
        """The two shallow depths a simulation extrapolates from (`depth.depth_plan`); None: simulate
        every layer."""
        return depth_plan(self.config)

    def __getstate__(self) -> dict:
        """Pickled for a worker process: the config alone (the worker starts its own memo)."""
        return {"config": self.config}

    def __setstate__(self, state: dict) -> None:
        self.config, self.memo, self._depths = state["config"], {}, {}


def resolved(spec_model: str, model: ResolvedModel | PretrainedConfig | str | None) -> ResolvedModel:
    """`model` resolved (`ResolvedModel.of`), or the step's model `spec_model` when None."""
    return ResolvedModel.of(spec_model if model is None else model)
