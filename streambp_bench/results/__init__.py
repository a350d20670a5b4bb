"""Results CSVs: the row schema, the files, older schemas, provenance."""
