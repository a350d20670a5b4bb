"""The one token parser of every length option: k = 1000, ki = 1024, m = 10^6, mi = 2^20."""

from __future__ import annotations

import argparse

import pytest

from streambp_bench import tokens
from streambp_core.config import AUTO, ConfigError


def test_token_lists_take_k_as_1000_as_the_plots_do_and_ki_as_1024() -> None:
    assert tokens.parse_token_list("1k,2048") == (1000, 2048)
    assert tokens.parse_token_list("4k:16k:4k") == (4000, 8000, 12000, 16000)
    assert tokens.parse_token_list("100, 100,1.5k") == (100, 1500)
    assert tokens.parse_token_list("4ki:8Ki:4KI,1K") == (4096, 8192, 1000)
    assert tokens.parse_token_list("500,1k,2k,5k", "partition size") == (500, 1000, 2000, 5000)  # the paper's


@pytest.mark.parametrize("text", ["", "4x", "0", "8k:4k:1k", "1:2", "-5"])
def test_bad_token_lists_raise_config_error(text: str) -> None:
    with pytest.raises(ConfigError):
        tokens.parse_token_list(text)



@pytest.mark.parametrize(("text", "expected"), [("2k", 2000), ("2ki", 2048), ("1.5m", 1_500_000),
                                                ("1mi", 1_048_576), ("0.064k", 64), (" 500 ", 500)])
def test_one_count_takes_every_suffix(text: str, expected: int) -> None:
    assert tokens.parse_tokens(text) == expected


def test_a_partition_option_is_counts_with_the_same_suffixes_or_auto() -> None:
    assert [tokens.parse_partitions(text, "--ps") for text in ("2k", "2ki", "AUTO")] == [(2000,), (2048,),
                                                                                          (AUTO,)]
    assert tokens.parse_partitions("1k,2k:4k:1k", "--ps") == (1000, 2000, 3000, 4000)
    with pytest.raises(ConfigError, match=r"bad LM-head partition '0'.*--ps-head sets head_partition_size"):
        tokens.parse_partitions("0", "--ps-head")
    with pytest.raises(ConfigError, match=r"bad partition size 'auto'"):
        tokens.parse_partitions("auto,1k", "--ps")


def test_an_argparse_option_reports_a_bad_count_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ps", type=tokens.token_count("partition size"), default=0)
    assert parser.parse_args(["--ps", "2k"]).ps == 2000 and parser.parse_args([]).ps == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--ps", "0.5"])
    assert "argument --ps: bad partition size '0.5': must be a whole number" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "expected"), [("2.01k", 2010), (str(2**53 + 1), 2**53 + 1),
                                                ("1.000001m", 1_000_001), ("0.001k", 1)])
def test_a_count_is_parsed_exactly_not_in_floating_point(text: str, expected: int) -> None:
    assert tokens.parse_tokens(text) == expected


def test_a_count_that_is_not_whole_names_its_value() -> None:
    with pytest.raises(ConfigError, match=r"'1.0001k': must be a positive whole .* \(it is 1000.1\)"):
        tokens.parse_tokens("1.0001k")
