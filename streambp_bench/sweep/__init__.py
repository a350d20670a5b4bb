"""`sweep` behind the command: the grid of training steps, each point run into result rows."""
