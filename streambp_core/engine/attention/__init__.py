"""Attention kernels a chunk's queries run against the key/value prefix: the CPU op (`prefix`), the CUDA
kernels (`cuda`: flash-attn or SDPA; `blocked`: a tiled backward), packed rows' varlen kernel (`varlen`),
their workspace as the simulator sees it (`workspace`), and transformers' attention interface (`hf`)."""
