"""The second baseline: Hugging Face `generate` on the stock target, behind the decoder's interface.

`HFGenerate(target, cfg).generate(prompt_ids)` returns a `GenerationResult` like
`SpeculativeDecoder.generate`, with the same stop rules (stop ids, stop strings, max_new_tokens, the
context limit), so evaluation and benchmarks time it in the same harness. It lives here, beside the
target adapter, because it calls transformers' `generate`; the speculative decoder stays pure torch.
"""

from __future__ import annotations

import time

import torch

from eagle_train.config.decode import DecodeConfig
from eagle_train.decoding.decoder import GenerationResult, StopRules
from eagle_train.decoding.stats import GenerationStats


class HFGenerate:
    """`model.generate` of a `Target` (greedy, or sampled with temperature / top-p / top-k)."""

    def __init__(self, target, cfg: DecodeConfig):
        self.target, self.cfg = target, cfg

    def generate(self, prompt_ids) -> GenerationResult:
        """Generate a continuation of one prompt (token ids)."""
        cfg, target = self.cfg, self.target
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=target.device).flatten()
        if not 0 < prompt.numel() < target.max_len:
            raise ValueError(
                f"prompt of {prompt.numel()} tokens: must be 1..{target.max_len - 1} (context limit)"
            )
        stats = GenerationStats(prompt_tokens=prompt.numel())
        out = StopRules(cfg, prompt.numel(), target.max_len, target.stop_token_ids, target.tokenizer)
        kwargs = dict(
            do_sample=cfg.temperature > 0, max_new_tokens=out.limit, eos_token_id=target.stop_token_ids
        )
        if cfg.temperature > 0:
            kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k_sampling or None)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        pad = target.tokenizer.pad_token_id
        start = time.perf_counter()
        with torch.inference_mode():
            ids = target.model.generate(
                prompt.unsqueeze(0),
                attention_mask=torch.ones_like(prompt).unsqueeze(0),
                pad_token_id=pad if pad is not None else target.stop_token_ids[0],
                **kwargs,
            )
        out.extend(ids[0, prompt.numel() :].tolist())
        stats.time_total = time.perf_counter() - start
        stats.new_tokens = len(out.tokens)
        return GenerationResult(tokens=out.tokens, stop_reason=out.reason or "max_new_tokens", stats=stats)
