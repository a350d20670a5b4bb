"""The pieces of a `*ForCausalLM` of the baselines tier (`models.catalogue`), found without a family table.

plain and checkpoint need only the decoder stack, the embedding, the decoder layers and the LM head
(`decoder_parts`); transformers' own forward and checkpointing do the rest. mst needs more
(`mst_pieces`): in every decoder layer one MLP module that acts token by token on a (B, T, d) input,
which it runs in sequence chunks, and logits that are the LM head's output alone (no scale, soft-cap or
bias after it), which it streams.

Steps of `decoder_parts`:
1. the decoder stack: the model's `base_model` (transformers' own pointer past the head);
2. its layers: the shallowest `nn.ModuleList` of transformers `GradientCheckpointingLayer`s (the modules
   its activation checkpointing wraps), else of `num_hidden_layers` modules;
3. the embedding and the head: `get_input_embeddings()` and `get_output_embeddings()`;
4. the final norm: the stack's child named as transformers names it (`norm`, `ln_f`, ...), else an identity.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

from torch import nn

from streambp_core.config import ConfigError

FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "norm_f", "final_layer_norm", "final_norm")
"""Names transformers gives a decoder stack's final norm."""
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn", "moe", "feedforward")
"""Names transformers gives a decoder layer's MLP (dense or mixture of experts)."""
PER_TOKEN_MLP_INPUTS = ("input_ids",)
"""Keyword inputs a layer may hand its MLP beside the hidden states that are per-token (B, T) and carry no
gradient, which mst's chunks cut with the hidden states (DeepSeek-V4's hash-routed MoE picks each token's
experts from its id)."""


def decoder_layers(stack: nn.Module, num_layers: int | None) -> nn.ModuleList:
    """The decoder layers of `stack` (module docstring, step 2); ConfigError when there is none."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    lists = [module for _, module in _breadth_first(stack)
             if isinstance(module, nn.ModuleList) and len(module)]
    for wanted in (lambda m: all(isinstance(layer, GradientCheckpointingLayer) for layer in m),
                   lambda m: len(m) == num_layers):
        found = next((module for module in lists if wanted(module)), None)
        if found is not None:
            return found
    raise ConfigError(f"{type(stack).__name__} has no list of decoder layers (no nn.ModuleList of "
                      "GradientCheckpointingLayer, nor of num_hidden_layers modules)")


def _breadth_first(root: nn.Module):
    """(name, module) of `root`'s submodules, shallowest first."""
    level = [("", root)]
    while level:
        yield from level
        level = [(f"{name}.{child_name}".lstrip("."), child) for name, module in level
                 for child_name, child in module.named_children()]


def final_norm(stack: nn.Module) -> nn.Module:
    """The stack's final norm (module docstring, step 4), or an identity."""
    return next((getattr(stack, name) for name in FINAL_NORMS
                 if isinstance(getattr(stack, name, None), nn.Module)), nn.Identity())


def generic_parts(base: nn.Module) -> dict[str, object]:
    """The fields of the `adapters.DecoderParts` of a causal LM of the baselines tier (module docstring's
    steps), which `adapters.decoder_parts` builds (this module does not import it: adapters imports this
    one); its `rotary` is None (only streambp reads it, which refuses such a model)."""
    stack = base.base_model
    layers = decoder_layers(stack, getattr(base.config, "num_hidden_layers", None))
    head = base.get_output_embeddings()
    if head is None:
        raise ConfigError(f"{type(base).__name__} has no LM head (get_output_embeddings() is None)")
    return {"backbone": stack, "embed": base.get_input_embeddings(), "layers": layers,
            "norm": final_norm(stack), "lm_head": head, "rotary": None, "family": base.config.model_type}


@dataclass(frozen=True)
class MstPieces:
    """What mst runs in chunks on a model: each decoder layer's MLP, and whether its head streams."""

    mlps: tuple[nn.Module, ...]


def layer_mlp(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's MLP module by transformers' names (`MLP_NAMES`), when its forward takes the
    hidden states alone (one tensor argument) and the layer's forward hands it nothing more but per-token
    keyword inputs (`PER_TOKEN_MLP_INPUTS`: DeepSeek-V4's hash-routed MoE is also given `input_ids`); None
    otherwise."""
    name = next((name for name in MLP_NAMES if isinstance(getattr(layer, name, None), nn.Module)), None)
    if name is None:
        return None
    mlp = getattr(layer, name)
    parameters = [p for p in inspect.signature(mlp.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    return mlp if len(parameters) == 1 and not _called_with_more(layer, name) else None


def _called_with_more(layer: nn.Module, name: str) -> bool:
    """Whether the layer's forward, as its source reads, calls `self.<name>(...)` with more than one
    argument, a per-token keyword input (`PER_TOKEN_MLP_INPUTS`) aside, wherever it calls it (Moshi's calls
    it with the hidden states alone unless its config asks for per-codebook weights)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(layer).forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == name
             and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"]
    return bool(calls) and all(len(call.args) > 1 or any(keyword.arg not in PER_TOKEN_MLP_INPUTS
                                                         for keyword in call.keywords) for call in calls)


def returns_pair(mlp: nn.Module) -> bool:
    """Whether the MLP's forward returns a pair (hidden states, router scores), as its source's `return`
    statements say (a mixture of experts that hands its router logits to its layer)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(mlp).forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    returned = [node.value for node in ast.walk(tree) if isinstance(node, ast.Return)]
    return any(isinstance(value, ast.Tuple) and len(value.elts) == 2 for value in returned)


def head_is_lm_head(model: nn.Module) -> bool:
    """Whether the causal LM's forward computes its logits as `lm_head`'s output alone: its source assigns
    `logits` once, from `self.lm_head(...)` (no scale, soft-cap or bias after it, which mst's streamed
    head would leave out)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(model).forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    assigned = [node for node in ast.walk(tree)
                if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign)
                and any(isinstance(target, ast.Name) and target.id == "logits" for target in _targets(node))]
    if len(assigned) != 1 or not isinstance(assigned[0].value, ast.Call):
        return False
    called = assigned[0].value.func
    return (isinstance(called, ast.Attribute) and called.attr == "lm_head"
            and isinstance(called.value, ast.Name) and called.value.id == "self")


def _targets(node: ast.AST) -> list[ast.AST]:
    return node.targets if isinstance(node, ast.Assign) else [node.target]


def mst_pieces(model: nn.Module, layers: nn.ModuleList) -> MstPieces:
    """mst's pieces on `model` (of the baselines tier), or ConfigError naming the piece it lacks."""
    family = getattr(model.config, "model_type", type(model).__name__)
    mlps = [layer_mlp(layer) for layer in layers]
    if any(mlp is None for mlp in mlps):
        index = mlps.index(None)
        raise ConfigError(f"mst: architecture {family!r} has no token-wise MLP module in decoder layer "
                          f"{index} ({type(layers[index]).__name__}: none of {', '.join(MLP_NAMES)} taking "
                          "the hidden states alone); plain and checkpoint run it")
    if not head_is_lm_head(model):
        raise ConfigError(f"mst: architecture {family!r} changes the logits after its lm_head "
                          f"({type(model).__name__}.forward), which mst's chunked head does not; plain and "
                          "checkpoint run it")
    return MstPieces(tuple(mlps))


def step_failure(method: str, model_type: str, error: BaseException) -> str:
    """The one-line refusal of a baselines family whose step cannot run on the meta device, naming the
    failure (an op without a meta kernel, a value read from a meta tensor, an error in its own code)."""
    what = " ".join(str(error).split())[:240] or type(error).__name__
    return (f"{method}: the step of architecture {model_type!r} cannot run on the meta device "
            f"({type(error).__name__}: {what}); measure it on cpu or cuda")
