"""The simulator: a step's peak memory predicted on a CPU by running the real step on meta tensors
(`simulate`), one sequence-parallel rank through the engine (`sequence_layout`), one DeepSpeed ZeRO-3 rank
with DeepSpeed's own offload (`deepspeed_host`)."""
