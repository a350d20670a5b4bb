"""plain: the model untouched; transformers' own forward, loss and backward. The reference."""

from __future__ import annotations

from contextlib import ExitStack

from streambp_core.engine.hf_attention import engine_attention, engine_mask_argument
from streambp_core.methods.base import Run, full_logits_loss, key_padding


class PlainRun(Run):
    """Ordinary backpropagation: every activation of every layer and the full logits are kept."""

    method = "plain"

    def _setup(self) -> None:
        self._attention = ExitStack()
        if self.uses_engine_attention:
            self._attention.enter_context(engine_attention(self.model, self.config.attn))

    def _teardown(self) -> None:
        self._attention.close()

    @property
    def uses_engine_attention(self) -> bool:
        """Whether the transformers layers attend through the engine kernel (see StreamConfig)."""
        choice = self.config.baseline_attention
        if choice == "auto":
            return next(self.model.parameters()).device.type == "meta"
        return choice == "engine"

    def mask_argument(self, attention_mask):
        """The attention mask in the form the model's attention implementation expects."""
        if self.uses_engine_attention:
            return engine_mask_argument(key_padding(attention_mask))
        return attention_mask

    def _loss(self, input_ids, attention_mask, labels, **objective_inputs):
        mask = self.mask_argument(attention_mask)
        if self.objective_name == "sft" and not objective_inputs:
            return self.model(input_ids=input_ids, attention_mask=mask, labels=labels, use_cache=False).loss
        logits = self.model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
        return full_logits_loss(self, logits, labels, **objective_inputs)
