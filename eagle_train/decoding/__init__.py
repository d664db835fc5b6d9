"""Speculative decoding: draft trees (tree, expand), verification (verify), the draft side (drafter,
lean_draft), the static KV cache (kv_cache) and the decoder (decoder)."""
