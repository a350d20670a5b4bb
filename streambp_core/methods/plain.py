"""plain: the model untouched; transformers' own forward, loss and backward. The reference."""

from __future__ import annotations

from streambp_core.methods.base import Run, full_logits_loss


class PlainRun(Run):
    """Ordinary backpropagation: every activation of every layer and the full logits are kept."""

    method = "plain"

    def _loss(self, input_ids, attention_mask, labels, **objective_inputs):
        if self.objective_name == "sft" and not objective_inputs:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        return full_logits_loss(self, logits, labels, **objective_inputs)
