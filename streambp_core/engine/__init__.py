"""The engine, in rooms, each importing only the rooms below it (the import-linter contract in
pyproject.toml): `sequence` > `stream` > `attention` > `host` > `engines` > `chunks` and `packing` (the
chunk ranges and the packed rows' data, which every room reads)."""
