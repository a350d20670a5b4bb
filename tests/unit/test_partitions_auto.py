"""AUTO partitions in the spec: what reads them, the size a search runs them at (`searched`), their
resolution at a length (`resolve_partitions`), and the refusal of one that reaches a step."""

from __future__ import annotations

import pytest

from streambp_core.config import AUTO, MIN_AUTO_PARTITION, ConfigError, StepSpec, StreamConfig
from streambp_core.methods import prepare
from streambp_core.models.load import load_config
from streambp_core.step.run.setup import build_setup
from streambp_core.step.search.partitions import fitting_partitions, resolve_partitions, searched
from streambp_core.step.simulation.simulate import simulate

SPEC = StepSpec.of(model="tiny/qwen3", method="streambp", seq_len_tokens=1024, dtype="float32")
BUDGET = 5_003_706  # bytes: partitions (171, 256) fit, (256, 64) and (171, 512) do not


def test_a_partition_reads_auto_or_a_positive_count() -> None:
    assert StreamConfig().automatic == ()
    assert StreamConfig(partition_size=AUTO).automatic == ("partition_size",)
    both = StreamConfig(partition_size=AUTO, head_partition_size=AUTO)
    assert both.automatic == ("partition_size", "head_partition_size")
    for bad in ("Auto", "64", 0, True):
        with pytest.raises(ConfigError, match="partition_size must be a positive integer"):
            StreamConfig(head_partition_size=bad)


def test_a_search_runs_auto_at_the_smallest_candidate_and_given_sizes_as_they_are() -> None:
    spec = SPEC.replaced(partition_size=AUTO, head_partition_size=32)
    run = searched(spec)
    assert (run.stream.partition_size, run.stream.head_partition_size) == (MIN_AUTO_PARTITION, 32)
    assert run.stream.automatic == () and run.replaced(partition_size=AUTO) == spec
    assert searched(SPEC) is SPEC


def test_auto_partitions_resolve_to_the_largest_that_fit_the_others_kept() -> None:
    both = resolve_partitions(SPEC.replaced(partition_size=AUTO, head_partition_size=AUTO), BUDGET)
    assert (both.stream.partition_size, both.stream.head_partition_size) == (171, 256)
    layer = resolve_partitions(SPEC.replaced(partition_size=AUTO, head_partition_size=64), BUDGET)
    assert layer == fitting_partitions(SPEC.replaced(head_partition_size=64), BUDGET, head=False)
    assert layer.stream.head_partition_size == 64 and layer.stream.automatic == ()
    assert resolve_partitions(SPEC, BUDGET) is SPEC


def test_a_method_without_partitions_resolves_to_the_searched_sizes() -> None:
    checkpoint = StepSpec.of(model="tiny/qwen3", method="checkpoint", partition_size=AUTO,
                             head_partition_size=AUTO)
    assert resolve_partitions(checkpoint, BUDGET) == searched(checkpoint)


def test_auto_partitions_nothing_fits_are_refused() -> None:
    with pytest.raises(ConfigError, match="no partition fits"):
        resolve_partitions(SPEC.replaced(partition_size=AUTO), 1000)


def test_an_auto_partition_that_reaches_a_step_is_a_programming_error() -> None:
    spec = SPEC.replaced(seq_len_tokens=64, head_partition_size=AUTO)
    with pytest.raises(ValueError, match="head_partition_size auto: resolve the automatic partitions"):
        simulate(spec)
    with pytest.raises(ValueError, match="resolve_partitions"):
        build_setup(spec, load_config(spec.model), "meta")
    with pytest.raises(ValueError, match="partition_size auto"):
        prepare(object(), "streambp", partition_size=AUTO)  # refused before the model is looked at
