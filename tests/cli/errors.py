"""The one check every CLI test of bad input makes: exit 2 and one `error:` line on stderr."""

from __future__ import annotations


def one_line_error(result, *words: str) -> str:
    """Assert `result` (a CliRunner result) failed with exit 2 and exactly one `error:` line on stderr,
    no traceback, holding every one of `words`; return that line."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and all(word in lines[0] for word in words), lines[0]
    return lines[0]
