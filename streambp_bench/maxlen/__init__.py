"""`max-len` behind the command: the plan and its searches, automatic partitions, the report."""
