"""The autotune tests decode with the decoder tests' heads (tests/decoding/conftest.py)."""

from tests.decoding.conftest import random_head, trained_eagle3_head, trained_head, trained_peagle_head  # noqa: F401 (fixtures)
