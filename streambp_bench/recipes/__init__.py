"""`streambp-bench plan`: the recipes searched (`space`), the search (`search`, `run`), the answer
(`report`) and the files that run the chosen recipe (`launch`)."""
