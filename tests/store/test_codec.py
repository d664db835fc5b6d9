"""The stored dtypes (eagle_train.store.codec): fp8 e4m3 with per-token scales, measured against its bound."""

from __future__ import annotations

import pytest
import torch

from eagle_train.store.codec import FP8_MAX, Fp8UnavailableError, decode, encode, storage

FP8 = storage("fp8")


def test_fp8_keeps_every_value_within_e4m3s_rounding_of_its_tokens_range():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen) * torch.logspace(-3, 3, 64)[:, None]  # rows 6 decades apart
    x[3, 7] = 900.0  # an outlier channel sets its token's scale, not the others'
    codes, scale = encode(x, FP8, group=256)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape and scale.shape == (64, 1)
    assert torch.allclose(scale[:, 0], x.abs().amax(-1) / FP8_MAX)
    back = decode(codes, scale, torch.float32)
    # e4m3: 3 mantissa bits, so a normal value rounds within 1/16 of itself; below the smallest normal
    # (2^-6 of the scale's unit) the absolute error is at most half a subnormal step (2^-10)
    bound = torch.maximum(x.abs() / 16, scale * 2**-10)
    assert bool(((back - x).abs() <= bound * 1.0001).all())
    assert torch.isfinite(back).all() and decode(codes, scale, torch.bfloat16).dtype == torch.bfloat16


def test_fp8_groups_scale_each_state_of_a_row_alone_and_zero_rows_stay_zero():
    x = torch.zeros(2, 3 * 8)
    x[0, :8], x[0, 8:16], x[0, 16:] = 1000.0, 1.0, 0.001  # three layers' states of one token
    codes, scale = encode(x, FP8, group=8)
    assert scale.shape == (2, 3)
    torch.testing.assert_close(decode(codes, scale, torch.float32), x, rtol=1 / 16, atol=0)
    assert bool((decode(codes, scale, torch.float32)[1] == 0).all())


def test_unscaled_dtypes_are_plain_casts_and_bytes_per_row_are_counted():
    x = torch.randn(4, 16)
    values, scale = encode(x, storage("bfloat16"), group=16)
    assert scale is None and torch.equal(decode(values, None, torch.float32), x.to(torch.bfloat16).float())
    assert storage("bfloat16").row_bytes(4096, 4096) == 8192 and FP8.row_bytes(4096, 4096) == 4100
    assert FP8.row_bytes(3 * 4096, 4096) == 3 * 4096 + 12


def test_fp8_on_a_torch_without_float8_is_refused_naming_the_field(monkeypatch):
    import eagle_train.store.codec as codec

    monkeypatch.setattr(codec, "float8_dtype", lambda: None)
    with pytest.raises(Fp8UnavailableError, match=r"dtype=fp8 needs torch.float8_e4m3fn"):
        FP8.dtype  # noqa: B018
