"""Speculative decoding: draft trees (tree, expand), verification (verify), the decoder (decoder)."""
