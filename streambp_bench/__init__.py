"""streambp-bench: the command-line benchmark around `streambp_core` (verify, presets, ...)."""

__version__ = "0.1.0"
