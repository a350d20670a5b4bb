"""The streamed (chunked) computations: a decoder layer's forward and backward chunk by chunk along the
sequence (`layer`), the LM head and its objectives (`head`, `objectives`), and the pieces they share:
RoPE, a chunk's linear-layer gradients, the MoE router, the chunked MLP."""
