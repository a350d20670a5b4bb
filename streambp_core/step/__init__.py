"""One training step, from its spec to its figures, in rooms whose imports only point down
(pyproject's import contract): `search` and `estimate` over `simulation`, over `run`, over `parts`.

    from streambp_core.config import StepSpec
    from streambp_core.step.simulation.simulate import simulate

    spec = StepSpec.of(model="Qwen/Qwen3-8B", method="streambp", seq_len_tokens=65536)
    simulate(spec).peak_gib

- `search`: the largest partitions that fit (`partitions`); probes for the max-length search (simulated,
  measured on CPU, measured on CUDA in a child process) and `max_len`, the guided search over them
  (`probe`);
- `estimate`: step time on a named GPU: the aten ops a step dispatches (`ops`), the roofline over them
  (`roofline`), attention kernels' speed curves, several GPUs (`sequence_time`), one entry point
  (`step_estimate`), packing (`packed`);
- `simulation`: the one simulator (meta tensors; depth extrapolation and chunk thinning as parameters),
  one sequence-parallel rank, one DeepSpeed ZeRO-3 rank with its own offload;
- `run`: StepSpec -> model, optimizer, inputs (`setup`); one tracked step with phase cuts (`tracked`);
  the paper's measurement script as reversible patches (`protocol`); memoised meta kernels and the logits
  category (`simulation_mode`); warm-up, repeats, p20/p50/p80 (`timing`);
- `parts`: the model config resolved once (`resolved`) and its simulated depths (`depth`), device and
  budget (`target`), random batches and objective inputs (`batch`), the optimizer (`optim`), the host pool
  (`host_pool`), one rank of N under a shard stage (`shards`).
"""
