"""Sharded engines under the streamed backward: an FSDP2 unit's gather and reduce (`fsdp_unit`), ZeRO-3's
parameter hooks (`zero3`), gradient reduction once per parameter (`reduction`), DeepSpeed's host tiers
(`deepspeed_tiers`) and the per-unit hooks they share (`unit_hooks`)."""
