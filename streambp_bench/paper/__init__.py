"""The paper's numbers: one module per reproduced item (its run, figure and README section), the
published values, what the items share, the README composer over its Markdown template, and the plots."""
