"""A target's own processing of its LM head's output (pure torch).

Most causal LMs give softmax(lm_head(h)). Some process the logits first, in their `ForCausalLM.forward`:
Gemma-2/3 softcap them (`final_logit_softcapping`: cap * tanh(z / cap)), Granite and MiniCPM3 divide them
(`logits_scaling`), Cohere (`logit_scale`) and Falcon-H1 (`lm_head_multiplier`) multiply them. That is the
model's distribution, so every place that turns a feature into a distribution applies it: verification
(the target's logits), the soft targets and the draft distribution of training's CE, and the draft's
own distribution at decode time. `LogitTransform` is the processing as data; it is read from a model's
config in one place, `eagle_train.modeling.target.logit_transform`, which refuses a model whose output
it does not reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitTransform:
    """logits -> softcap(scale * logits): scale first, then cap * tanh(. / cap) when `softcap` is set."""

    scale: float = 1.0  # multiplies the logits (Granite: 1 / logits_scaling; Cohere: logit_scale)
    softcap: float | None = None  # Gemma-2/3: final_logit_softcapping

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits [..., vocab] (same dtype)."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
