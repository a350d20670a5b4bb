"""Estimated step time on a named GPU: the ops a step dispatches (`ops`), the roofline over them
(`roofline`), the attention kernels' published speed curves (`attention_kernels`), steps over several GPUs
(`sequence_time`), the one entry point per `StepSpec` (`step_estimate`) and what packing changes
(`packed`). Every figure it gives is labelled `estimated`."""
