"""The gradient rows of the self-check: every method of one verified step against plain, a row each
(metric grad_rel_err), shared by the gradient item (`selfcheck.check`) and the families item
(`selfcheck.families`)."""

from __future__ import annotations

from collections.abc import Iterator

from streambp_bench.results import ResultRow, provenance, row_head_mode
from streambp_core.verify.methods import VerifySpec, verify_spec


def grad_rows(spec: VerifySpec, where: str) -> Iterator[ResultRow]:
    """`spec` verified (`verify_spec`): one row per method, metric grad_rel_err, status error beyond the
    method's bound."""
    step = spec.step
    for result in verify_spec(spec).results:
        yield ResultRow(
            method=result.method, model=step.model, objective=step.objective,
            seq_len_tokens=step.seq_len_tokens, batch_size=step.batch_size,
            partition_size=step.stream.partition_size, head_partition_size=step.stream.head_partition_size,
            dtype=step.dtype, attn=step.stream.attn, head_mode=row_head_mode(spec.step_of(result.method)),
            status="ok" if result.ok else "error",
            metric="grad_rel_err", value=result.max_rel_err,
            error="" if result.ok else f"{result.max_rel_err:.3g} > bound {result.tolerance:.3g}",
            **provenance(f"measured-{spec.device}", where),
        )
