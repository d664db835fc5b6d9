"""What the decode-time forward must reproduce of a target's attention, and the masks that do it.

The decoder runs the stock model with its own 4-D mask (a tree: each node sees the prefix and its
ancestors). Hugging Face returns a ready 4-D mask as it is, so whatever the model's own mask functions add
on top of causality must be added here, or the decoder (and the `ar` baseline, which shares this code)
silently computes another model. Read from the (text) config, as the model's own forward reads it:

- sliding-window layers: a query at position p sees keys at positions > p - window (transformers'
  `sliding_window_overlay`). A config with `layer_types` (Gemma-2/3, gpt-oss, Qwen2/3, Cohere2, ...)
  gets one mask per layer type, handed over as `{layer type: mask}`, which those models take as is; a
  config without it (Mistral, Phi-3, Mixtral, Qwen3-MoE) uses `sliding_window` for every layer, as their
  forward does (`create_sliding_window_causal_mask` whenever `sliding_window` is set);
- what cannot be reproduced under a tree mask is refused here, naming the architecture and the reason:
  recurrent layers (linear attention, Mamba: their state is not a per-token cache a tree can branch),
  chunked attention, bidirectional attention.

Attention sinks (gpt-oss) and MLA (DeepSeek-V3) need nothing here: sinks live inside the attention
function, and MLA's keys/values reach the cache as ordinary (if unequal-width) tensors
(`modeling.target.Target.cache_shape`). `modeling.target.check_decode` proves the result on a probe
(the cached tree forward against cache-free forwards of the model) before any decode-time use.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from eagle_train.runtime.errors import InputError

FULL, SLIDING = "full_attention", "sliding_attention"
# Config fields of hybrid models with recurrent (state-space / linear-attention) layers.
HYBRID_FIELDS = ("layers_block_type", "hybrid_override_pattern", "attn_layer_indices", "mamba_d_state")


class UnsupportedAttention(InputError):
    """The target's attention cannot be reproduced exactly by the decode-time forward."""


@dataclass(frozen=True)
class AttentionLayout:
    """The sliding window of each mask the model reads (None: full causal), and whether it reads them
    per layer type (`{type: mask}`) or one mask for every layer (`windows` then has one entry)."""

    windows: dict[str, int | None]
    per_layer_type: bool

    @functools.cached_property
    def max_window(self) -> int | None:
        """The widest sliding window (None when no layer has one; read once per decode-time forward)."""
        sizes = [w for w in self.windows.values() if w is not None]
        return max(sizes) if sizes else None

    def masks(
        self,
        mask: torch.Tensor,  # bool [1, 1, q, k]: True = attend (causality / the tree)
        query_positions: torch.Tensor,  # [q]
        key_positions: torch.Tensor,  # [k]
        dtype: torch.dtype,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The additive float mask(s) the model's forward takes: one tensor, or {layer type: mask}."""
        by_window: dict[int | None, torch.Tensor] = {}
        for window in set(self.windows.values()):
            allowed = mask
            if window is not None:  # transformers' sliding_window_overlay: key > query - window
                allowed = mask & (query_positions[:, None] - key_positions[None, :] < window)
            by_window[window] = additive_mask(allowed, dtype)
        if not self.per_layer_type:
            return by_window[self.windows["all"]]
        return {kind: by_window[window] for kind, window in self.windows.items()}


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True = attend) as the additive float mask (0 / dtype's min) that eager
    attention needs; sdpa takes it too (converted once here rather than a boolean one in each layer: 2-4% of a
    stories260K verification forward on a CPU, same logits bit for bit)."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(dtype).min)


def attention_layout(config) -> AttentionLayout:
    """The layout of a Hugging Face (text) config; UnsupportedAttention when the decode-time forward cannot
    reproduce it exactly."""
    name = getattr(config, "model_type", type(config).__name__)
    layer_types = list(getattr(config, "layer_types", None) or [])
    if getattr(config, "attention_chunk_size", None) or "chunked_attention" in layer_types:
        raise UnsupportedAttention(
            f"{name}: chunked attention (attention_chunk_size={getattr(config, 'attention_chunk_size', None)}) "
            "is not reproduced by the built-in decoder's masks; not supported"
        )
    hybrid = [f for f in HYBRID_FIELDS if getattr(config, f, None) is not None]
    recurrent = sorted({t for t in layer_types if t not in (FULL, SLIDING)})
    if hybrid or recurrent:
        raise UnsupportedAttention(
            f"{name}: layers with recurrent state ({', '.join(recurrent or hybrid)}) cannot be verified "
            "exactly under a tree's attention mask (their state is not a per-token cache that a tree can "
            "branch and a rejected draft can roll back); the built-in decoder refuses this target. "
            "Extraction and training are plain forwards and work; serve the head with an engine that "
            "supports this architecture's speculative decoding"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedAttention(f"{name}: bidirectional attention is not a causal LM's; not supported")
    window = getattr(config, "sliding_window", None)
    if not layer_types:
        return AttentionLayout({"all": int(window) if window else None}, per_layer_type=False)
    if SLIDING in layer_types and not window:
        raise UnsupportedAttention(f"{name}: sliding_attention layers but no sliding_window in its config")
    windows = {kind: int(window) if kind == SLIDING else None for kind in dict.fromkeys(layer_types)}
    if len(set(windows.values())) == 1:  # one kind of layer: one mask, whichever way the model reads it
        return AttentionLayout({"all": next(iter(windows.values()))}, per_layer_type=False)
    return AttentionLayout(windows, per_layer_type=True)


@contextlib.contextmanager
def attention_implementation(config, implementation: str):
    """Run the model's forwards with another attention implementation (config and sub-configs), then
    restore its own. Attention layers read the implementation from the config at each forward."""
    own = config._attn_implementation
    if own == implementation:
        yield
        return
    config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = own
