"""Sequence parallelism (Ulysses): the ranks' group (`group`), its all-to-all attention (`attention`), the
streamed layer across ranks (`layer`) and transformers' attention under it (`hf`)."""
