"""Refusals `prepare` makes for a user's hooks that a method would run a different number of times than
plain backprop does, or not at all (so a gradient or a hook's side effect would silently differ):

- checkpoint recomputes each decoder layer in backward, calling the forward (pre-)hooks of the modules
  inside it a second time;
- mst also runs each MLP and the LM head chunk by chunk (their hooks fire once per chunk, a parameter's
  tensor hook sees no gradient of the head) and never calls the model's own forward;
- streambp drives the decoder layers, the final norm and the LM head through its own autograd functions:
  their module hooks never run and their parameters' gradients are written into `.grad`, not returned
  through autograd (a tensor hook on one would see None). A post-accumulate-grad hook fires once per
  backward under every method, as the engine hands each parameter's gradient over once.

Hooks the project's own engines and the integrations it supports register (peft, transformers,
accelerate, DeepSpeed, torch's FSDP2) are told apart by the module their function is defined in; a
method re-arranges those to fire as plain's do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from torch import nn
from torch.nn.modules import module as torch_module

from streambp_core.config import ConfigError

MODULE_HOOKS = {
    "_forward_pre_hooks": "forward pre-hook",
    "_forward_hooks": "forward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_backward_hooks": "backward hook",
}
"""A module's hook dictionaries (as `nn.Module` keeps them) and what each holds."""

PARAM_HOOKS = {
    "_backward_hooks": "tensor hook (register_hook)",
    "_post_accumulate_grad_hooks": "post-accumulate-grad hook",
}
"""A parameter's hook dictionaries (as `torch.Tensor` keeps them) and what each holds."""

FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks")
"""The module hooks a recompute calls again."""

SUPPORTED_ORIGINS = frozenset({"streambp_core", "torch", "transformers", "peft", "accelerate", "deepspeed",
                               "trl"})
"""Top-level packages whose hooks are the project's or a supported integration's, never refused."""


@dataclass(frozen=True)
class HookScope:
    """Modules (each with its children when `subtree`) whose hooks of `module_kinds` and whose parameters'
    hooks of `param_kinds` a method cannot run as plain does, and why (`refuse_hooks`' message)."""

    modules: tuple[nn.Module, ...]
    why: str
    module_kinds: tuple[str, ...] = tuple(MODULE_HOOKS)
    param_kinds: tuple[str, ...] = ()
    subtree: bool = True


def hook_origin(hook: object) -> str:
    """The top-level package `hook`'s function is defined in ('' when unknown); a partial's or a bound
    method's function counts."""
    function = getattr(hook, "func", hook)
    function = getattr(function, "__func__", function)
    module = getattr(function, "__module__", None) or type(function).__module__ or ""
    return module.split(".")[0]


def user_hooks(hooks: dict | None) -> list:
    """The hooks in one hook dictionary that no supported package registered."""
    return [hook for hook in (hooks or {}).values() if hook_origin(hook) not in SUPPORTED_ORIGINS]


def _scope_modules(scope: HookScope) -> Iterator[nn.Module]:
    for root in scope.modules:
        yield from root.modules() if scope.subtree else (root,)


def found_hooks(model: nn.Module, scope: HookScope) -> Iterator[str]:
    """'<kind> on <name>' for each user hook `scope` covers in `model` (names as `named_modules` gives
    them, '(the model)' for the model itself)."""
    module_names = {id(m): name or "(the model)" for name, m in model.named_modules(remove_duplicate=False)}
    param_names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    seen: set[int] = set()
    for module in _scope_modules(scope):
        if id(module) in seen:
            continue
        seen.add(id(module))
        for kind in scope.module_kinds:
            if user_hooks(getattr(module, kind, None)):
                yield f"a {MODULE_HOOKS[kind]} on {module_names.get(id(module), type(module).__name__)}"
        for param in module.parameters(recurse=False):
            for kind in scope.param_kinds:
                if user_hooks(getattr(param, kind, None)):
                    yield f"a {PARAM_HOOKS[kind]} on parameter {param_names.get(id(param), '?')}"


def global_hooks() -> Iterator[str]:
    """'<kind> on every module' for each user hook registered for all modules at once
    (`torch.nn.modules.module.register_module_forward_hook` and its kin)."""
    for kind, label in MODULE_HOOKS.items():
        if user_hooks(getattr(torch_module, f"_global{kind}", None)):
            yield f"a global {label} (on every module)"


def refuse_hooks(method: str, model: nn.Module, scopes: Iterable[HookScope]) -> None:
    """ConfigError naming the first user hook in `scopes` (or registered globally, when there are scopes)
    that `method` cannot run as plain backprop does."""
    scopes = list(scopes)
    if not scopes:
        return
    for found in global_hooks():
        raise ConfigError(f"{method} cannot run {found} as plain backprop does: it calls the modules a "
                          "different number of times; remove the hook or use plain")
    for scope in scopes:
        for found in found_hooks(model, scope):
            raise ConfigError(f"{method} cannot run {found} as plain backprop does: {scope.why}; remove "
                              "the hook or use plain")


def above(model: nn.Module, inner: Iterable[nn.Module]) -> tuple[nn.Module, ...]:
    """The modules of `model` in none of `inner`'s subtrees: the causal LM and any wrapper around it."""
    below = {id(m) for root in inner for m in root.modules()}
    return tuple(m for m in model.modules() if id(m) not in below)
