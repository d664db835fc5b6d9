"""The greedy-identity contract and how a differing answer is classified (pure torch + stdlib).

In float32, greedy speculative decoding emits exactly the tokens of plain greedy decoding. In bf16 or
fp16 that cannot hold bit for bit: a verification forward over a 60-node tree and a one-token forward
sum in another order, so their logits differ by a few units in the last place (ulps) of the dtype,
and where the target's top two logits are that close their argmax can differ. The two answers then
part at that token and continue from different prefixes. The contract the evaluation checks:

    every greedy answer that differs from plain decoding's first differs at a NEAR-TIE: at the first
    differing token, both candidates (plain decoding's token and the speculative one) have logits
    within `ulps` ulps of the top logit, in the logits' dtype, on the common prefix.

Anything else is a REAL DIVERGENCE (a bug: the decoder emitted a token the target did not choose).

Plain decoding (`ar`) is itself checked against the MODEL (`check_against_model`): one teacher-forced,
cache-free forward of the model over prompt + answer must choose every answer token (up to the same
near-ties). `ar` shares the speculative methods' cache and mask code, so this is the check that sees a
bug common to all of them (a sliding window the cache ignores).
The report counts identical answers, near-ties and real divergences; only real divergences mean "not
lossless". (On a CPU, stories260K in bf16 parts from plain decoding at a near-tie in most answers.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch


def first_divergence(reference: Sequence[int], tokens: Sequence[int]) -> int | None:
    """Index of the first token where the two differ (the shorter length when one is a prefix of the
    other); None when they are equal."""
    for i, (a, b) in enumerate(zip(reference, tokens, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def logit_ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s representable numbers at |value| (one unit in the last place)."""
    info = torch.finfo(dtype)
    magnitude = max(abs(value), info.tiny)
    return info.eps * 2.0 ** math.floor(math.log2(magnitude))


def classify_divergence(
    logits: torch.Tensor,  # [vocab]: the target's logits at the first differing token (common prefix)
    reference_token: int,  # plain decoding's token there
    token: int,  # the speculative decoder's token there
    dtype: torch.dtype,  # the dtype the target computes its logits in
    ulps: int,  # tolerance in ulps (EvaluateConfig.near_tie_ulps)
) -> dict:
    """{"kind": "near_tie" | "divergence", "gap": top logit - the lower of the two, "ulp": the dtype's ulp
    at the top logit, "tokens": [reference_token, token]}."""
    logits = logits.float()
    top = float(logits.max())
    gap = top - min(float(logits[reference_token]), float(logits[token]))
    ulp = logit_ulp(top, dtype)
    kind = "near_tie" if gap <= ulps * ulp else "divergence"
    return {"kind": kind, "gap": gap, "ulp": ulp, "tokens": [int(reference_token), int(token)]}


def classify_answer(
    prompt: list[int],
    reference: list[int],  # plain decoding's answer
    tokens: list[int],  # the speculative decoder's answer to the same prompt
    next_logits: Callable[[list[int]], torch.Tensor],  # ids -> the target's logits [vocab] after them
    dtype: torch.dtype,
    ulps: int,
) -> dict | None:
    """None when the answers are equal; else where they part and how: {"index", "kind", "gap", "ulp",
    "tokens"} (an answer that is a prefix of the other: a stop rule fired elsewhere, a real divergence)."""
    index = first_divergence(reference, tokens)
    if index is None:
        return None
    if index >= min(len(reference), len(tokens)):
        return {"index": index, "kind": "divergence", "gap": None, "ulp": None, "tokens": []}
    logits = next_logits(prompt + reference[:index])
    return {"index": index, **classify_divergence(logits, reference[index], tokens[index], dtype, ulps)}


def check_against_model(
    prompt: list[int],
    tokens: list[int],  # a greedy answer to `prompt`
    sequence_logits: Callable[[list[int]], torch.Tensor],  # ids -> the model's logits [len(ids), vocab]
    dtype: torch.dtype,
    ulps: int,
) -> dict:
    """Whether every token of a greedy answer is the MODEL's own choice, from one teacher-forced forward of
    the model over prompt + answer (its own cache-free forward and masks: a reference that shares nothing
    with the decoder's cache and tree-mask code, so a bug common to `ar` and the speculative methods shows).
    {"kind": "identical"} or, at the first token that is not the model's argmax, {"index", "kind":
    "near_tie" | "divergence", "gap", "ulp", "tokens": [the model's token, the answer's]}."""
    if not tokens:
        return {"kind": "identical"}
    # [len(tokens), vocab]: the logits each answer token was chosen from
    logits = sequence_logits(prompt + tokens[:-1])[len(prompt) - 1 :]
    choices = logits.argmax(dim=-1).tolist()
    index = first_divergence(choices, tokens)
    if index is None:
        return {"kind": "identical"}
    found = classify_divergence(logits[index], choices[index], tokens[index], dtype, ulps)
    return {"index": index, **found}
