"""How a store keeps its hidden states: the stored dtypes and the fp8 code (torch only).

    bfloat16 | float16 | float32   the values as they are, cast
    fp8                            float8 e4m3 (4 exponent bits, 3 mantissa bits, no infinity, max 448) with
                                   one float32 scale per token and per `hidden_size` group of a row (the
                                   EAGLE-1 feature is one group, EAGLE-3's three auxiliary states three):
                                   value = code * scale, scale = absmax(group) / 448

Per-token scales follow the hidden states' real range, which swings from token to token (a BOS token's
residual stream is hundreds of times larger than the next one's); within a group e4m3's exponent covers a
range of 2^15 at a relative step of 1/16, so a finer grouping (per channel block) buys little
(scripts/bench_store_dtype.py measures both). At d = 4096 a token costs 4096 + 4 bytes instead of bf16's
8192: 0.5005x. Decoding happens on the training device (`decode`), so the host only moves the codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_train.runtime.errors import InputError, UserError

FP8_MAX = 448.0  # the largest finite float8 e4m3fn value
TINY_SCALE = 1e-30  # the scale of an all-zero group (its codes are 0 whatever the scale)


def float8_dtype() -> torch.dtype | None:
    """torch's float8 e4m3fn, or None when this torch has none (torch < 2.1)."""
    return getattr(torch, "float8_e4m3fn", None)


@dataclass(frozen=True)
class Storage:
    """One stored dtype: its name in configs and manifests, the torch dtype of the stored values and
    whether each row carries scales."""

    name: str
    scaled: bool = False

    @property
    def dtype(self) -> torch.dtype:
        if self.scaled:
            fp8 = float8_dtype()
            if fp8 is None:
                raise Fp8UnavailableError(
                    f"dtype={self.name} needs torch.float8_e4m3fn, which torch {torch.__version__} lacks "
                    "(torch >= 2.1 has it): choose dtype=bfloat16 or upgrade torch"
                )
            return fp8
        return getattr(torch, self.name)

    @property
    def itemsize(self) -> int:
        return 1 if self.scaled else getattr(torch, self.name).itemsize

    def row_bytes(self, width: int, group: int) -> int:
        """Bytes one token's row of `width` values takes (scales included), `group` values per scale."""
        return width * self.itemsize + (4 * (width // group) if self.scaled else 0)


class Fp8UnavailableError(UserError, RuntimeError):
    """fp8 storage asked for on a torch without float8 (the message names the field)."""


STORAGES = {
    s.name: s for s in (Storage("bfloat16"), Storage("float16"), Storage("float32"), Storage("fp8", True))
}


def storage(name: str) -> Storage:
    """The Storage named `name` (ValueError naming the choices otherwise)."""
    if name not in STORAGES:
        raise InputError(f"unknown stored dtype {name!r}; expected one of {sorted(STORAGES)}")
    return STORAGES[name]


def encode(x: torch.Tensor, kind: Storage, group: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows [..., width] -> (stored values [..., width], scales [..., width // group] float32 or None).

    fp8: each group's absmax maps to 448 (computed in float32, codes clamped so rounding never leaves the
    finite range, which e4m3fn would turn into NaN)."""
    if not kind.scaled:
        return x.to(kind.dtype), None
    x = x.float()
    grouped = x.unflatten(-1, (x.shape[-1] // group, group))  # [..., groups, group]
    scale = (grouped.abs().amax(-1) / FP8_MAX).clamp_min(TINY_SCALE)  # [..., groups]
    codes = (grouped / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(kind.dtype)
    return codes.flatten(-2), scale


def decode(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored values (and their scales) -> `dtype` [..., width]; run it where the values are used (the
    training device), so the host moves only the stored bytes."""
    if scale is None:
        return values.to(dtype)
    groups = scale.shape[-1]
    grouped = values.unflatten(-1, (groups, values.shape[-1] // groups)).to(torch.float32)
    return (grouped * scale.float().unsqueeze(-1)).flatten(-2).to(dtype)
