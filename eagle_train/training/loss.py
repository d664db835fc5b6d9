"""The EAGLE training objectives as pure tensor functions (torch only).

A sequence of tokens t_0..t_{L-1} with target features f_0..f_{L-1} (f_j = the target's last hidden
state at j, the LM head's input, predicting t_{j+1}) gives L-1 head positions j = 0..L-2:

    input (f_j, t_{j+1})  ->  regression target f_{j+1},  token target t_{j+2}

and position j is trained iff the token it predicts, t_{j+2}, lies in an assistant reply
(loss_mask[j + 2] in sequence indexing; the reference's unshifted mask is EAGLE issue #317).

EAGLE-3 (`ttt_loss_sums`, `combine_ttt_terms`): the input feature is a_j (the inputs of three target
layers) and the head is unrolled over its own outputs (eagle_train.training.ttt). Its step k at column j
predicts t_{j+2+k}: every step-0 alignment above moves k columns on (`shift_left(x, k)`: the target's
distribution lm_head(f_{j+1+k}), the token t_{j+2+k}, the mask mask[j+2+k]). The loss of a step is the
soft CE against the target's distribution restricted to the draft vocabulary, over the assistant
positions whose token is in that vocabulary; the total is sum_k decay^k * mean CE_k, no regression.

P-EAGLE (`parallel_loss_sums`): the same soft CE (or KL) per element of its COD sequence (eagle_train.training.cod),
an element at head position a + d (anchor a, depth d) aligned as that position is above; the total is the
CE sum over all depths / their trainable elements (no decay: `combine_ttt_terms` with one pooled term).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eagle_train.config.train import NOISE_MODES
from eagle_train.modeling.logit_transform import LogitTransform


def shift_batch(
    input_ids: torch.Tensor,  # [b, T] t_0..t_{T-1}, right-padded with 0
    loss_mask: torch.Tensor,  # [b, T] bool, True where t_i is an assistant token (False on padding)
    hidden: torch.Tensor,  # [b, T, d] f_0..f_{T-1} (padding rows: anything)
    lengths: torch.Tensor,  # [b] real tokens per row
    aux: torch.Tensor | None = None,  # [b, T, 3d] EAGLE-3: a_0..a_{T-1}, the inputs of the aux layers
) -> dict[str, torch.Tensor]:
    """A right-padded batch's head inputs and targets, all of length T-1 (head position j), on the
    batch's device: input_ids t_{j+1}, features f_j (EAGLE-3: a_j), target_hidden f_{j+1} (the target's
    distribution of t_{j+2} is lm_head(f_{j+1})), target_ids t_{j+2} (0 past the end), loss_mask
    mask[j+2] (False past each row's end), positions [b] = lengths - 1.

    The one home of the shift: past a row's end every input and target is padding (0, mask False), exactly
    as if each sequence were shifted alone and padded afterwards, whatever the padding rows held (online:
    the target's states of pad tokens)."""
    if input_ids.ndim != 2 or input_ids.shape[1] < 2 or bool((lengths < 2).any()):
        raise ValueError(
            f"need sequences of at least 2 tokens, got shape {tuple(input_ids.shape)}, lengths {lengths.tolist()}"
        )
    real = torch.arange(input_ids.shape[1], device=input_ids.device)[None] < lengths[:, None]  # [b, T]
    ids = torch.where(real, input_ids, 0).long()
    mask = loss_mask.bool() & real
    inside = real[:, 1:, None]  # [b, n, 1]: head position j < length - 1
    return {
        "input_ids": ids[:, 1:],  # [b, n] t_{j+1}
        "features": (hidden if aux is None else aux)[:, :-1].masked_fill(~inside, 0),  # [b, n, d|3d]
        "target_hidden": hidden[:, 1:].masked_fill(~inside, 0),  # [b, n, d] f_{j+1}
        "target_ids": F.pad(ids[:, 2:], (0, 1)),  # [b, n] t_{j+2}
        "loss_mask": F.pad(mask[:, 2:], (0, 1)),  # [b, n] mask[j+2]
        "positions": lengths - 1,  # [b] real head positions per row
    }


def shift_sequence(
    input_ids: torch.Tensor,  # [L] t_0..t_{L-1}
    loss_mask: torch.Tensor,  # [L] bool, True where t_i is an assistant token
    hidden: torch.Tensor,  # [L, d] f_0..f_{L-1}
    aux: torch.Tensor | None = None,  # [L, 3d] EAGLE-3: a_0..a_{L-1}, the inputs of the aux layers
) -> dict[str, torch.Tensor]:
    """One sequence's head inputs and targets, all of length L-1 (head position j): `shift_batch` of a
    batch of one (input_ids t_{j+1}, features f_j (EAGLE-3: a_j), target_hidden f_{j+1}, target_ids
    t_{j+2}, loss_mask mask[j+2])."""
    if input_ids.ndim != 1 or input_ids.shape[0] < 2:
        raise ValueError(f"need a 1-D sequence of at least 2 tokens, got shape {tuple(input_ids.shape)}")
    length = torch.tensor([input_ids.shape[0]], device=input_ids.device)
    shifted = shift_batch(
        input_ids[None], loss_mask[None], hidden[None], length, None if aux is None else aux[None]
    )
    return {k: v[0] for k, v in shifted.items() if k != "positions"}


def shift_left(x: torch.Tensor, k: int, fill: int | float | bool) -> torch.Tensor:
    """x[:, j + k] at column j, `fill` past the end ([batch, n, ...]): step k's view of a step-0
    aligned tensor."""
    if k == 0:
        return x
    out = torch.full_like(x, fill)
    out[:, :-k] = x[:, k:]
    return out


def add_feature_noise(
    features: torch.Tensor,  # [batch, seq, hidden]
    mode: str = "uniform",
    scale: float = 0.1,
    generator: torch.Generator | None = None,
    lengths: torch.Tensor | None = None,  # [batch] each sequence's token count (length_scaled)
) -> torch.Tensor:
    """Noise on the head's INPUT features (never on the regression target, never at evaluation).

    uniform: f + U(-scale, scale) (the paper). length_scaled: the reference's (rand - 0.5) * 2 * scale *
    512 / L with L each sequence's own token count (its stored hidden states, as the reference draws it
    per sample), i.e. U(+-scale) only at length 512; `lengths` None = every row is seq + 1 tokens long
    (no padding). The padded batch length is never used: a short sequence in a long batch keeps its own.
    """
    if mode == "none" or scale == 0:
        return features
    if mode not in NOISE_MODES:
        raise ValueError(f"noise mode must be one of {NOISE_MODES}, got {mode!r}")
    u = torch.rand(features.shape, generator=generator, device=features.device, dtype=torch.float32)
    amplitude = torch.full((features.shape[0], 1, 1), scale, device=features.device)
    if mode == "length_scaled":
        if lengths is None:
            lengths = torch.full((features.shape[0],), features.shape[1] + 1)
        amplitude = amplitude * 512.0 / lengths.to(features.device, torch.float32).view(-1, 1, 1)
    return features + ((u - 0.5) * 2.0 * amplitude).to(features.dtype)


# Positions per chunk of the vocabulary projection: the [chunk, vocab] float32 intermediates stay near
# a fixed number of elements each whatever the sequence length. On an accelerator 2^26 (256 MB; vocab
# 128k: 512 positions per chunk), few large matmuls over the LM head; on the CPU 2^22 (16 MB; vocab 32k:
# 131 positions), where the five or so intermediates of one chunk are resident memory on top of the
# weights and AdamW: scripts/bench_memory.py at llama-1b-32k, 512-token batches, measured 2207 MB peak RSS
# with 2^26 and 2118 MB with 2^22 (both with the allocator setting of eagle_train.runtime.allocator).
CHUNK_ELEMENTS = 2**26
CPU_CHUNK_ELEMENTS = 2**22


def chunk_positions(
    vocab_size: int, device: torch.device | str = "cpu", chunk_elements: int | None = None
) -> int:
    """Positions per chunk so that a [chunk, vocab] tensor holds about `chunk_elements` elements (default:
    the device's, above)."""
    if chunk_elements is None:
        chunk_elements = CPU_CHUNK_ELEMENTS if torch.device(device).type == "cpu" else CHUNK_ELEMENTS
    return max(1, chunk_elements // max(vocab_size, 1))


def _chunk_ce(
    pred: torch.Tensor,  # [c, hidden] f^, requires grad when a gradient is wanted
    target: torch.Tensor,  # [c, hidden] f
    weight: torch.Tensor,  # [vocab, hidden]
    target_ids: torch.Tensor,  # [c]
    soft: bool,
    transform: LogitTransform,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed CE and top-1 agreement count of one chunk of positions (logits in float32, processed as
    the target processes its own)."""
    draft_logp = torch.log_softmax(
        transform((pred.to(weight.dtype) @ weight.T).float()), dim=-1
    )  # [c, vocab]
    with torch.no_grad():
        target_logits = transform((target.to(weight.dtype) @ weight.T).float())  # [c, vocab]
        correct = (draft_logp.argmax(-1) == target_logits.argmax(-1)).sum()
        target_p = torch.softmax(target_logits, dim=-1) if soft else None
    if soft:
        ce = -(target_p * draft_logp).sum()
    else:
        ce = F.nll_loss(draft_logp, target_ids, reduction="sum")
    return ce, correct


class _ChunkedCE(torch.autograd.Function):
    """The CE over N positions, a chunk at a time, with its gradient w.r.t. the predicted features taken
    chunk by chunk in the forward (local autograd per chunk). Only the [N, hidden] gradient is kept for
    the backward, never a [N, vocab] tensor: memory is bounded whatever N. The LM head is frozen (no
    gradient). Same values and gradient as the one-shot computation (tests/training/test_loss.py)."""

    @staticmethod
    def forward(ctx, pred, target, weight, target_ids, soft: bool, chunk: int, transform: LogitTransform):
        want_grad = pred.requires_grad
        grad = torch.zeros_like(pred) if want_grad else None
        ce = torch.zeros((), dtype=torch.float32, device=pred.device)
        correct = torch.zeros((), dtype=torch.long, device=pred.device)
        for lo in range(0, pred.shape[0], chunk):
            part = pred[lo : lo + chunk].detach().requires_grad_(want_grad)
            with torch.set_grad_enabled(want_grad):
                part_ce, part_correct = _chunk_ce(
                    part, target[lo : lo + chunk], weight, target_ids[lo : lo + chunk], soft, transform
                )
            if want_grad:
                (grad[lo : lo + chunk],) = torch.autograd.grad(part_ce, part)
            ce += part_ce.detach()
            correct += part_correct
        ctx.save_for_backward(grad if want_grad else pred.new_zeros(0))
        ctx.mark_non_differentiable(correct)
        return ce, correct

    @staticmethod
    def backward(ctx, grad_ce, grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_ce.to(grad.dtype), None, None, None, None, None, None


def eagle_loss_sums(
    pred_hidden: torch.Tensor,  # [batch, seq, hidden] f^_{j+1}
    target_hidden: torch.Tensor,  # [batch, seq, hidden] f_{j+1}
    lm_head_weight: torch.Tensor,  # [vocab, hidden], the target's frozen LM head
    target_ids: torch.Tensor,  # [batch, seq] t_{j+2}
    loss_mask: torch.Tensor,  # [batch, seq] bool
    soft: bool = True,
    chunk: int | None = None,
    transform: LogitTransform | None = None,
) -> dict[str, torch.Tensor]:
    """Per-term SUMS over the masked positions (divide by a token count to average).

    smooth_l1: SmoothL1(f^, f) averaged over the hidden dimension. ce: cross entropy of the draft
    distribution softmax(T(lm_head(f^))) against softmax(T(lm_head(f))) (soft) or the token t_{j+2}
    (hard), T the target's output processing (`transform`, eagle_train.modeling.logit_transform; default
    none).
    correct: positions where the draft's top-1 equals the target's greedy token argmax(lm_head(f)).
    Only the masked positions go through the LM head, `chunk` positions at a time (default:
    `chunk_positions(vocab, device)`), so memory stays bounded at any sequence length and vocabulary. The
    projection runs in the LM head's dtype (no float32 copy of it), softmax and sums in float32.
    """
    mask = loss_mask.bool()
    pred = pred_hidden[mask].float()  # [N, hidden]
    target = target_hidden[mask].float()  # [N, hidden]
    smooth_l1 = F.smooth_l1_loss(pred, target, reduction="none").mean(-1).sum()
    chunk = chunk or chunk_positions(lm_head_weight.shape[0], lm_head_weight.device)
    transform = transform or LogitTransform()
    ce, correct = _ChunkedCE.apply(
        pred, target.detach(), lm_head_weight.detach(), target_ids[mask], soft, chunk, transform
    )
    return {"smooth_l1": smooth_l1, "ce": ce, "correct": correct.float(), "tokens": mask.sum().float()}


def combine_terms(
    sums: dict[str, torch.Tensor],
    num_tokens: float | torch.Tensor,
    feature_weight: float = 1.0,
    token_weight: float = 0.1,
) -> dict[str, torch.Tensor]:
    """Averages over `num_tokens` masked positions and the total feature_weight * SmoothL1 +
    token_weight * CE: the one place the loss total is formed (training steps, log windows, evaluation).

    Pass the global token count of the optimizer step (all micro-batches, all processes) so every
    position weighs the same however the batch is split.
    """
    denom = torch.clamp(torch.as_tensor(num_tokens, dtype=torch.float32), min=1.0)
    smooth_l1 = sums["smooth_l1"] / denom
    ce = sums["ce"] / denom
    return {"loss": feature_weight * smooth_l1 + token_weight * ce, "smooth_l1": smooth_l1, "ce": ce}


def ttt_target_probs(
    target_hidden: torch.Tensor,  # [batch, n, d] f_{j+1}
    kept_lm_head: torch.Tensor,  # [draft_vocab, d] the target LM head's rows of the draft vocabulary
    trainable: torch.Tensor,  # [batch, n] bool: the positions with a soft target
    transform: LogitTransform | None = None,  # the target's output processing (elementwise)
) -> torch.Tensor:
    """[batch, n, draft_vocab] float32: softmax of the target's logits over the kept tokens at the
    trainable positions, 0 elsewhere. Step k's targets are this shifted k columns (`shift_left`), so one
    micro-batch computes them once for every unrolled step."""
    with torch.no_grad():
        probs = torch.zeros(*trainable.shape, kept_lm_head.shape[0], device=trainable.device)
        logits = target_hidden[trainable].float() @ kept_lm_head.float().T  # [N, draft_vocab]
        probs[trainable] = torch.softmax(transform(logits) if transform is not None else logits, dim=-1)
    return probs


def ttt_loss_sums(
    hidden: torch.Tensor,  # [batch, n, d] the draft's output at step k (column j predicts t_{j+2+k})
    draft_logits: Callable[[torch.Tensor], torch.Tensor],  # [N, d] -> [N, draft_vocab]: the head's
    target_probs: torch.Tensor | None,  # [batch, n, draft_vocab] soft: step k's `ttt_target_probs`
    draft_ids: torch.Tensor,  # [draft_vocab] the target id of each draft token (d2t + arange)
    t2d: torch.Tensor,  # [vocab] bool: token kept in the draft vocabulary
    labels: torch.Tensor,  # [batch, n] the token that decides the mask (soft: target greedy; hard: t_{j+2+k})
    greedy: torch.Tensor,  # [batch, n] the target's greedy token argmax(lm_head(f_{j+1+k}))
    loss_mask: torch.Tensor,  # [batch, n] bool: mask[j+2+k], the predicted token is an assistant token
    soft: bool = True,
) -> dict[str, torch.Tensor]:
    """One TTT step's SUMS. ce over the trainable positions (assistant, label kept), against
    softmax(target logits over the kept tokens) (soft: `target_probs`, 0 at the other positions) or the
    label's draft id (hard); correct: draft top-1, mapped to a target id, equals the target's greedy
    token, over ALL assistant positions (a token outside the draft vocabulary is a miss, as at decode
    time); tokens / positions: the counts."""
    mask = loss_mask.bool()
    trainable = mask & t2d[labels]  # [batch, n]
    logits = draft_logits(hidden[mask]).float()  # [M, draft_vocab]
    draft_logp = torch.log_softmax(logits, dim=-1)  # [M, draft_vocab]
    if soft:
        ce = -(target_probs[mask] * draft_logp).sum()
    else:
        draft_index = torch.cumsum(t2d.long(), 0) - 1  # [vocab] draft id of each kept token
        ignored = torch.full_like(labels, -100)
        ce = F.nll_loss(
            draft_logp, torch.where(trainable, draft_index[labels], ignored)[mask], reduction="sum"
        )
    # max(-1).indices: argmax's first maximal index, 3x faster than argmax on the CPU at [4k, 512]
    correct = (draft_ids[logits.max(-1).indices] == greedy[mask]).sum().detach()
    return {
        "ce": ce,
        "correct": correct.float(),
        "tokens": trainable.sum().float(),
        "positions": mask.sum().float(),
    }


def combine_ttt_terms(
    step_ce: list[torch.Tensor], step_tokens: list[float | torch.Tensor], decay: float = 0.8
) -> dict[str, torch.Tensor]:
    """The EAGLE-3 loss total: sum_k decay^k * (CE sum of step k / its trainable tokens), with the
    global counts of the optimizer step (all micro-batches, all processes): the one place it is formed."""
    means = [
        ce / torch.clamp(torch.as_tensor(n, dtype=torch.float32), min=1.0)
        for ce, n in zip(step_ce, step_tokens, strict=True)
    ]
    total = sum(decay**k * mean for k, mean in enumerate(means))
    return {"loss": total, **{f"ce_step{k + 1}": mean for k, mean in enumerate(means)}}


def checkpointed_chunks(part: Callable, tensors: Sequence[torch.Tensor], chunk: int) -> list:
    """`part(*slices)` over `tensors` (sliced alike along dim 0) `chunk` rows at a time, its outputs in
    order. With a gradient wanted and several chunks, each chunk is recomputed in the backward (activation
    checkpointing): no [rows, vocab] tensor a part makes outlives its chunk, whatever the row count."""
    rows = tensors[0].shape[0]
    several = tensors[0].requires_grad and rows > chunk
    outs = []
    for lo in range(0, rows, chunk):
        args = [x[lo : lo + chunk] for x in tensors]
        outs.append(checkpoint(part, *args, use_reentrant=False) if several else part(*args))
    return outs


def parallel_loss_sums(
    states: torch.Tensor,  # [M, d] the draft's outputs of the elements on the loss mask
    draft_logits: Callable[[torch.Tensor], torch.Tensor],  # [c, d] -> [c, draft_vocab]: the head's
    target_hidden: torch.Tensor,  # [M, d] f at each element's position (its target is lm_head(f))
    kept_lm_head: torch.Tensor,  # [draft_vocab, d] the target LM head's rows of the draft vocabulary
    labels: torch.Tensor,  # [M] hard: the draft id of the data token (soft: unused)
    greedy: torch.Tensor,  # [M] the target's greedy token (a target id)
    trainable: torch.Tensor,  # [M] bool: the element's token is in the draft vocabulary
    depth: torch.Tensor,  # [M] each element's depth, 0..num_depths-1
    draft_ids: torch.Tensor,  # [draft_vocab] the target id of each draft token
    num_depths: int,
    soft: bool = True,
    kl: bool = False,
    transform: LogitTransform | None = None,
    chunk: int | None = None,
    parents: torch.Tensor | None = None,  # [M] the element's depth-(d-1) element of its chain, -1: none
) -> dict[str, torch.Tensor]:
    """P-EAGLE's per-depth SUMS [num_depths] over its COD elements (eagle_train.training.cod): `ce` the soft CE
    against the target's distribution over the draft vocabulary (`kl`: KL(target || draft), the same
    gradient; hard: the data token's draft id) at the trainable elements, no depth decay; `correct` draft
    top-1 == the target's greedy token over every element (a token outside the draft vocabulary is a
    miss); `tokens` / `positions` the counts. With `parents` (loss.cod.weighting=accepted) an element's CE
    counts only where every earlier element of its chain drafted the target's greedy token (`chain_accepted`).
    The draft vocabulary's [c, V] logits exist one chunk at a time (`chunk` elements, default
    `chunk_positions`): with several chunks each is recomputed in the backward (activation checkpointing),
    so memory stays bounded at any element count."""
    chunk = chunk or chunk_positions(kept_lm_head.shape[0], states.device)

    def part(st, th, lab, gr, tr):
        logp = torch.log_softmax(draft_logits(st).float(), dim=-1)  # [c, V]
        with torch.no_grad():
            target = (th.float() @ kept_lm_head.float().T)[tr]
            target = torch.softmax(transform(target) if transform is not None else target, dim=-1)
            hit = (draft_ids[logp.max(-1).indices] == gr).float()
        if soft:
            row = -(target * logp[tr]).sum(-1)
            row = row + torch.special.xlogy(target, target).sum(-1) if kl else row
        else:
            row = F.nll_loss(logp[tr], lab[tr], reduction="none")
        return row, hit  # row: [trainable elements of the chunk]

    outs = checkpointed_chunks(part, (states, target_hidden, labels, greedy, trainable), chunk)
    rows, hits = [out[0] for out in outs], [out[1].detach() for out in outs]
    zeros = torch.zeros(num_depths, device=states.device)
    if not rows:
        return {"ce": zeros, "correct": zeros, "tokens": zeros, "positions": zeros}
    row, hit = torch.cat(rows), torch.cat(hits)  # [trainable elements], [M]
    if parents is not None:
        row = row * chain_accepted(hit, parents, depth, num_depths)[trainable]
    return {
        "ce": zeros.index_add(0, depth[trainable], row),
        "correct": zeros.index_add(0, depth, hit),
        "tokens": zeros.index_add(0, depth, trainable.float()),
        "positions": zeros.index_add(0, depth, torch.ones_like(depth, dtype=torch.float32)),
    }


def chain_accepted(
    hit: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, num_depths: int
) -> torch.Tensor:
    """[M] 1.0 where every earlier element of the element's chain (parent, its parent, ...) drafted the
    target's greedy token (`hit`), else 0.0; an element without a parent on the loss mask counts as reached.
    Masks only (no nonzero, no host sync on an accelerator: it runs in the training step)."""
    reached = torch.ones_like(hit)
    parent = parents.clamp(min=0)
    for d in range(1, num_depths):
        here = (depth == d) & (parents >= 0)
        reached = torch.where(here, reached[parent] * hit[parent], reached)
    return reached


def chain_parents(
    rows: torch.Tensor, positions: torch.Tensor, depth: torch.Tensor, shape, num_depths: int
) -> torch.Tensor:
    """[M] the index of each element's parent (same row, same anchor = position - depth, depth - 1) among
    the M elements (row [M], head position [M], depth [M] < num_depths of a batch [b, n]), -1 at depth 0 or
    when the parent is not among them."""
    b, n = shape
    anchor = positions - depth
    index = torch.full((b, n, num_depths), -1, dtype=torch.long, device=depth.device)
    index[rows, anchor, depth] = torch.arange(depth.numel(), device=depth.device)
    below = index[rows, anchor, (depth - 1).clamp(min=0)]
    return torch.where(depth > 0, below, torch.full_like(depth, -1))
