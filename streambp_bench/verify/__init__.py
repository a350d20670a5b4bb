"""`verify` beyond the command's own table: the sharded check across ranks."""
