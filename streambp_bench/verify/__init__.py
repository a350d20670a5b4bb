"""`verify`'s subcommands beyond the single-process table: the checks across ranks and of trainers."""
