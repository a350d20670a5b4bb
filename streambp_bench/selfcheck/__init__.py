"""`selfcheck` behind the command: the GPU self-check and its report."""
