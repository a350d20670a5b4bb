"""A user's hooks and `torch.autograd.grad` under every method: exactly plain's gradients and calls, or
refused by name (at `prepare` for a hook, at backward for autograd.grad) — never silently different."""

from __future__ import annotations

import functools

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.models.load import build_model, tiny_config

IDS = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
METHODS = ("checkpoint", "mst", "streambp")


def _scaled(out):
    return (out[0] * 1.1, *out[1:]) if isinstance(out, tuple) else out * 1.1


def _doubled(grads):
    return tuple(None if g is None else g * 2 for g in grads)


def _keep_grads(param, calls):
    return param.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))


HOOKS = {  # name: (module path, how to register a hook that counts its calls in `calls` and changes the step)
    "layer forward hook": ("model.layers.0", lambda m, c: m.register_forward_hook(
        lambda _m, _a, out: (c.append(1), _scaled(out))[1])),
    "layer forward pre-hook": ("model.layers.1", lambda m, c: m.register_forward_pre_hook(
        lambda _m, args: (c.append(1), _scaled(args))[1])),
    "inner forward pre-hook": ("model.layers.1.self_attn.o_proj", lambda m, c: m.register_forward_pre_hook(
        lambda _m, args: (c.append(1), _scaled(args))[1])),
    "mlp backward hook": ("model.layers.0.mlp", lambda m, c: m.register_full_backward_hook(
        lambda _m, grads, _out: (c.append(1), _doubled(grads))[1])),
    "attention backward pre-hook": ("model.layers.0.self_attn.o_proj",
                                    lambda m, c: m.register_full_backward_pre_hook(
                                        lambda _m, grads: (c.append(1), _doubled(grads))[1])),
    "head forward hook": ("lm_head", lambda m, c: m.register_forward_hook(
        lambda _m, _a, out: (c.append(1), _scaled(out))[1])),
    "model forward hook": ("", lambda m, c: m.register_forward_hook(lambda *_: c.append(1))),
    "mlp tensor hook": ("model.layers.0.mlp.down_proj", lambda m, c: m.weight.register_hook(
        lambda g: (c.append(1), g * 2)[1])),
    "norm tensor hook": ("model.layers.0.input_layernorm", lambda m, c: m.weight.register_hook(
        lambda g: (c.append(1), g * 2)[1])),
    "embedding tensor hook": ("model.embed_tokens", lambda m, c: m.weight.register_hook(
        lambda g: (c.append(1), g * 2)[1])),
    "mlp post-accumulate hook": ("model.layers.0.mlp.down_proj", lambda m, c: _keep_grads(m.weight, c)),
    "attention post-accumulate hook": ("model.layers.0.self_attn.q_proj",
                                       lambda m, c: _keep_grads(m.weight, c)),
}

REFUSED = {  # (hook, method): where the refusal says the hook is
    **{(hook, "streambp"): where for hook, where in [
        ("layer forward hook", r"model\.layers\.0 "), ("layer forward pre-hook", r"model\.layers\.1 "),
        ("inner forward pre-hook", r"model\.layers\.1\.self_attn\.o_proj"), ("mlp backward hook", "model"),
        ("attention backward pre-hook", "model"), ("head forward hook", "lm_head"),
        ("model forward hook", r"\(the model\)"), ("mlp tensor hook", r"parameter model\.layers\.0\.mlp"),
        ("norm tensor hook", r"parameter model\.layers\.0\.input_layernorm\.weight")]},
    **{(hook, "mst"): where for hook, where in [
        ("inner forward pre-hook", r"model\.layers\.1\.self_attn\.o_proj"),
        ("mlp backward hook", r"model\.layers\.0\.mlp "), ("head forward hook", "lm_head"),
        ("model forward hook", r"\(the model\)"), ("mlp tensor hook", r"parameter model\.layers\.0\.mlp"),
        ("mlp post-accumulate hook", r"parameter model\.layers\.0\.mlp")]},
    ("inner forward pre-hook", "checkpoint"): r"model\.layers\.1\.self_attn\.o_proj",
}


def _hooked(hook: str):
    model = build_model(tiny_config("llama"), dtype=torch.float64, seed=0)
    path, register = HOOKS[hook]
    calls: list = []
    register(model.get_submodule(path), calls)
    return model, calls


def _step(model, method: str):
    with streambp_core.prepare(model, method, partition_size=5, head_partition_size=4) as run:
        run.loss(IDS).backward()
    return {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("hook", list(HOOKS))
def test_a_hook_runs_as_under_plain_or_is_refused_by_name(hook, method):
    model, calls = _hooked(hook)
    if (hook, method) in REFUSED:
        with pytest.raises(ConfigError, match=rf"{method} cannot run a .* on {REFUSED[hook, method]}"):
            streambp_core.prepare(model, method)
        return
    grads = _step(model, method)
    reference, ref_calls = _hooked(hook)
    ref = _step(reference, "plain")
    assert len(calls) == len(ref_calls) >= 1
    for got, want in zip(calls, ref_calls, strict=True):  # a post-accumulate hook saw the whole gradient
        assert not isinstance(got, torch.Tensor) or torch.allclose(got, want, rtol=1e-12, atol=1e-15)
    assert all(torch.allclose(grads[name], ref[name], rtol=1e-12, atol=1e-15) for name in ref)


def test_a_refused_prepare_leaves_the_model_free_for_another_method():
    model, _ = _hooked("head forward hook")
    with pytest.raises(ConfigError):
        streambp_core.prepare(model, "streambp")
    with streambp_core.prepare(model, "checkpoint") as run:
        assert not run.closed


def test_a_global_module_hook_is_refused_by_the_methods_that_recompute():
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: None)
    try:
        for method in METHODS:
            with pytest.raises(ConfigError, match=rf"{method} cannot run a global forward hook"):
                streambp_core.prepare(build_model(tiny_config("llama"), dtype=torch.float64, seed=0), method)
    finally:
        handle.remove()


def test_a_hook_of_a_supported_package_is_not_refused():
    model = build_model(tiny_config("llama"), dtype=torch.float64, seed=0)
    hook = functools.partial(streambp_core.models.load.tiny_config)  # defined in streambp_core
    model.lm_head.register_forward_hook(lambda *_: None).remove()
    model.lm_head._forward_hooks[0] = hook  # as an engine's own hook sits there
    streambp_core.prepare(model, "streambp").close()


@pytest.mark.parametrize("method", ["plain", "checkpoint", "mst", "streambp"])
def test_autograd_grad_is_plains_or_refused_at_backward(method):
    model = build_model(tiny_config("llama"), dtype=torch.float64, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    with streambp_core.prepare(model, method, partition_size=5, head_partition_size=4) as run:
        loss = run.loss(IDS)
        if method in ("mst", "streambp"):
            with pytest.raises(RuntimeError, match=r"torch\.autograd\.grad .*not supported through .*"
                                                   rf"{method}.*use loss\.backward\(\)"):
                torch.autograd.grad(loss, params)
            return
        grads = torch.autograd.grad(loss, params)
    with streambp_core.prepare(model, "plain") as run:
        ref = torch.autograd.grad(run.loss(IDS), params)
    assert all(torch.allclose(g, r, rtol=1e-12, atol=1e-15) for g, r in zip(grads, ref, strict=True))


def test_backward_through_a_subset_of_inputs_is_refused_by_streambp():
    model = build_model(tiny_config("llama"), dtype=torch.float64, seed=0)
    with streambp_core.prepare(model, "streambp", partition_size=5, head_partition_size=4) as run:
        loss = run.loss(IDS)
        with pytest.raises(RuntimeError, match=r"backward\(inputs=\.\.\.\)\) is not supported"):
            loss.backward(inputs=[model.lm_head.weight])
