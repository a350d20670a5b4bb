"""Host memory tiers: checkpoints kept in host memory (`checkpoints`), parameters streamed from it
(`params`), the optimizer stepped on it (`optimizer`) and gradients handed to it per unit (`unit_grads`)."""
