"""`streambp-bench plan` at training scale, cold, timed: each case runs the command in a fresh process and
records its wall-clock and CPU seconds (measured-cpu, on this machine's cores) beside what the plan answers
and the checks that answer is held to.

    python benchmarks/plan_at_scale.py --out results/benchmarks/plan_at_scale.csv

Cases (the defaults are Qwen/Qwen3-8B on H100s):
- `cluster`: `plan -m MODEL --gpus N --gpu-model G --seq-len T --json`, a row per length. Checks: exit 0;
  at least 3 recipes ranked, each with an estimated step time; the fastest one's simulated peak within
  the budget; it no slower than ALST's recipe (mst, checkpoints offloaded, sp N, FSDP2 zero3; where the
  search left that one out as dominated, the same recipe without the tier, which runs the same
  partitions).
- `one-gpu`: `plan -m MODEL --gpu-model G --method streambp --json` (each recipe's longest length).
  Checks: exit 0; the recompute-head recipe without offload reaches the length `max-len` gives for it
  (`--ps auto --ps-head auto --optimizer adamw`, the same budget), run as one more command.

A failed check is named in `failed`, and the script exits 1 after writing every row. Step times in the
rows are `estimated`, peaks `simulated`, the runs' seconds `measured-cpu`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from csv_out import emit_rows

COLUMNS = ("case", "command", "exit_code", "wall_s", "cpu_s", "cores", "recipes_ranked", "top_recipe",
           "top_estimated_step_s", "top_simulated_peak_gib", "budget_gib", "alst_estimated_step_s",
           "plan_max_len_tokens", "max_len_tokens", "failed", "time_source", "step_time_source",
           "memory_source")
ALST = ("mst", "zero3", "checkpoints")
"""ALST's recipe on a cluster (method, stage, tiers), over sp = every GPU."""


def run_cli(args: list[str]) -> tuple[int, dict | None, float, float, str]:
    """(exit code, the JSON it printed or None, wall seconds, CPU seconds of the process and its
    children, stderr's last line) of `streambp-bench ARGS` in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "streambp_bench.cli", *args], capture_output=True,
                          text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    try:
        document = json.loads(done.stdout) if done.returncode == 0 else None
    except json.JSONDecodeError:
        document = None
    last = (done.stderr.strip().splitlines() or [""])[-1]
    return done.returncode, document, wall, cpu, last


def _row(case: str, args: list[str], code: int, wall: float, cpu: float, budget: float) -> dict:
    return {"case": case, "command": "streambp-bench " + " ".join(args), "exit_code": code,
            "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "cores": len(os.sched_getaffinity(0)),
            "budget_gib": budget, "time_source": "measured-cpu", "step_time_source": "estimated",
            "memory_source": "simulated"}


def cluster_row(model: str, gpu: str, gpus: int, seq_len: str, budget: float) -> dict:
    """The `cluster` case (module docstring)."""
    args = ["plan", "-m", model, "--gpus", str(gpus), "--gpu-model", gpu, "--seq-len", seq_len,
            "--budget-gib", str(budget), "--json"]
    code, document, wall, cpu, last = run_cli(args)
    row, failed = _row("cluster", args, code, wall, cpu, budget), []
    if document is None:
        return row | {"failed": f"exit {code}: {last}"}
    ranking = document["ranking"]
    timed = [entry for entry in ranking if entry.get("estimated_step_time_s")]
    row["recipes_ranked"] = len(ranking)
    if len(timed) < 3:
        failed.append(f"{len(timed)} recipes ranked with a step time, not 3")
    if ranking:
        top = ranking[0]
        row |= {"top_recipe": top["recipe"], "top_estimated_step_s": top.get("estimated_step_time_s"),
                "top_simulated_peak_gib": top["simulated_peak_gib"]}
        if top["simulated_peak_gib"] > budget:
            failed.append("the fastest recipe's peak is over the budget")
    alst = _alst(document, gpus)
    row["alst_estimated_step_s"] = None if alst is None else alst.get("estimated_step_time_s")
    if alst is None:
        failed.append("ALST's recipe is not ranked")
    elif ranking and ranking[0].get("estimated_step_time_s", 0) > alst.get("estimated_step_time_s", 0):
        failed.append("the fastest recipe is slower than ALST's")
    return row | {"failed": "; ".join(failed)}


def _alst(document: dict, gpus: int) -> dict | None:
    """ALST's recipe among the ranked ones, or, where it was dominated, the same recipe without the tier."""
    def matches(entry: dict, offload: str) -> bool:
        return (entry["method"], entry["shard"], entry["offload"], entry["sp"]) == (*ALST[:2], offload, gpus)

    found = [entry for entry in document["ranking"] if matches(entry, ALST[2])]
    if not found and any(matches(entry, ALST[2]) for entry in document["dominated"]):
        found = [entry for entry in document["ranking"] if matches(entry, "none")]
    return found[0] if found else None


def one_gpu_row(model: str, gpu: str, budget: float) -> dict:
    """The `one-gpu` case (module docstring)."""
    args = ["plan", "-m", model, "--gpu-model", gpu, "--method", "streambp", "--budget-gib", str(budget),
            "--json"]
    code, document, wall, cpu, last = run_cli(args)
    row = _row("one-gpu", args, code, wall, cpu, budget)
    if document is None:
        return row | {"failed": f"exit {code}: {last}"}
    entries = [entry for entry in document["ranking"]
               if entry["offload"] == "none" and entry["head_mode"] == "recompute"]
    row["recipes_ranked"] = len(document["ranking"])
    if not entries:
        return row | {"failed": "streambp (recompute head) without offload is not ranked"}
    entry = entries[0]
    row |= {"top_recipe": entry["recipe"], "top_estimated_step_s": entry.get("estimated_step_time_s"),
            "top_simulated_peak_gib": entry["simulated_peak_gib"],
            "plan_max_len_tokens": entry["seq_len_tokens"]}
    code, answer, _, _, last = run_cli([
        "max-len", "-m", model, "--method", "streambp", "--head-mode", "recompute", "--optimizer", "adamw",
        "--ps", "auto", "--ps-head", "auto", "--gpu-model", gpu, "--budget-gib", str(budget),
        "--device", "sim", "--json"])
    if answer is None:
        return row | {"failed": f"max-len exit {code}: {last}"}
    row["max_len_tokens"] = answer["results"][0]["max_len_tokens"]
    failed = [] if row["max_len_tokens"] == entry["seq_len_tokens"] else ["plan's length is not max-len's"]
    if entry["simulated_peak_gib"] > budget:
        failed.append("its peak is over the budget")
    return row | {"failed": "; ".join(failed)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="Qwen/Qwen3-8B", help="preset or model directory")
    parser.add_argument("--gpu-model", default="h100", help="h100, h200, a100 or a800")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the cluster case")
    parser.add_argument("--seq-len", default="256k,1M",
                        help="lengths of the cluster case, comma-separated (tokens: 256k, 1M, ...)")
    parser.add_argument("--budget-gib", type=float, default=79.65, help="GPU memory per GPU in GiB")
    parser.add_argument("--cases", default="cluster,one-gpu", help="which cases, comma-separated")
    parser.add_argument("--out", type=Path, help="CSV file for the rows (overwritten); none: print only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = {"cluster": lambda: [cluster_row(args.model, args.gpu_model, args.gpus, length, args.budget_gib)
                                 for length in args.seq_len.split(",")],
             "one-gpu": lambda: [one_gpu_row(args.model, args.gpu_model, args.budget_gib)]}
    unknown = sorted(set(args.cases.split(",")) - set(cases))
    if unknown:
        print(f"error: --cases: unknown {', '.join(unknown)} (cluster, one-gpu)", file=sys.stderr)
        return 2
    rows: list[dict] = []

    def produce():
        for name in args.cases.split(","):
            for row in cases[name]():
                rows.append(row)
                yield row

    code = emit_rows(produce, args.out, COLUMNS)
    return code or (1 if any(row["failed"] for row in rows) else 0)


if __name__ == "__main__":
    sys.exit(main())
