"""Every fact about a method lives on its class (`streambp_core.registry`), and every caller asks it by name:
the run a method prepares extends that class, the step's validation, the tier rules and the trainer
settings read it, and no fact leaks from one method's class to another's through the run classes'
inheritance."""

from __future__ import annotations

import pytest

from streambp_core.config import METHODS, VERIFY_METHODS, ConfigError, StepSpec, check_method
from streambp_core.integrations.settings import trainer_settings
from streambp_core.registry import METHOD_CLASSES, Method, method_class, methods_where
from streambp_core.tiers import Tiers, tier_problem

FACTS = tuple(name for name in Method.__annotations__ if name != "method")


def test_each_method_class_sets_every_fact_itself() -> None:
    """The run classes extend several method classes (mst's run extends checkpoint's and plain's), so a
    fact a method class left to inheritance would be another method's."""
    for cls in METHOD_CLASSES:
        missing = [name for name in ("method", *FACTS) if name not in vars(cls)]
        assert not missing, f"{cls.__name__} does not set {missing}"


def test_each_run_is_its_method_class_with_the_same_facts() -> None:
    from streambp_core.methods import RUN_CLASSES, run_class

    assert tuple(cls.method for cls in RUN_CLASSES) == METHODS
    for name in METHODS:
        run, facts = run_class(name), method_class(name)
        assert issubclass(run, facts) and run.method == name
        assert {fact: getattr(run, fact) for fact in FACTS} == {fact: getattr(facts, fact) for fact in FACTS}


def test_an_unknown_method_is_refused_by_name_everywhere() -> None:
    from streambp_core.methods import run_class

    with pytest.raises(KeyError, match="unknown method 'sgd'; choose from plain, checkpoint, mst, streambp"):
        method_class("sgd")
    for ask in (check_method, run_class, lambda name: StepSpec(model="tiny/llama", method=name)):
        with pytest.raises(ConfigError, match="unknown method 'sgd'"):
            ask("sgd")
    with pytest.raises(AttributeError, match="no method fact streams"):
        methods_where(streams=True)


def test_callers_read_the_facts_from_the_classes() -> None:
    """What a step, the tier rules, verify and the trainer settings say about each method is its class's."""
    assert VERIFY_METHODS == methods_where(reference=False) == ("checkpoint", "mst", "streambp")
    for name in METHODS:
        facts = method_class(name)
        assert StepSpec(model="tiny/llama", method=name).partitioned == facts.partitioned
        refused = tier_problem(name, Tiers(checkpoints=True)) is not None
        assert refused == (not facts.keeps_checkpoints)
        read = set(trainer_settings(name)) - {"method"}
        assert read == {option for option in facts.options if option.endswith("partition_size")}
    refusal = tier_problem("plain", Tiers(params=True))
    assert "use checkpoint, mst or streambp, or offload optimizer only" in refusal
