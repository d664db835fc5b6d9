"""The EAGLE loss: the exact shift, the mask alignment, the terms and the noise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle_train.training.loss import (
    add_feature_noise,
    combine_terms,
    combine_ttt_terms,
    eagle_loss_sums,
    shift_left,
    shift_sequence,
    ttt_loss_sums,
    ttt_target_probs,
)


def eagle_loss(pred, target, weight, ids, mask, feature_weight=1.0, token_weight=0.1, soft=True):
    """The loss averaged over one batch's masked positions, as the trainer forms it (sums, then terms)."""
    sums = eagle_loss_sums(pred, target, weight, ids, mask, soft)
    return combine_terms(sums, sums["tokens"], feature_weight, token_weight)


def test_shift_aligns_inputs_targets_and_mask_by_hand():
    # Sequence: 3 prompt tokens then a 3-token reply. f_i is "feature i" (all entries equal i).
    tokens = torch.tensor([10, 11, 12, 20, 21, 22])
    mask = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool)
    hidden = torch.arange(6, dtype=torch.float32)[:, None].expand(6, 4)  # [L, d], f_i = i
    s = shift_sequence(tokens, mask, hidden)
    # head position j: input (f_j, t_{j+1}) -> target f_{j+1}, token t_{j+2}
    assert s["input_ids"].tolist() == [11, 12, 20, 21, 22]
    assert s["features"][:, 0].tolist() == [0, 1, 2, 3, 4]
    assert s["target_hidden"][:, 0].tolist() == [1, 2, 3, 4, 5]
    assert s["target_ids"].tolist() == [12, 20, 21, 22, 0]
    # trained iff the PREDICTED token t_{j+2} is a reply token: j = 1 (predicts 20), 2 (21), 3 (22).
    # The reference's unshifted mask (EAGLE #317) would give [F, F, F, T, T] instead.
    assert s["loss_mask"].tolist() == [False, True, True, True, False]


def test_shift_refuses_too_short_sequences():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        shift_sequence(torch.tensor([1]), torch.tensor([True]), torch.zeros(1, 4))


def _random_case(seed: int = 0, b: int = 2, n: int = 7, d: int = 8, vocab: int = 11):
    g = torch.Generator().manual_seed(seed)
    pred = torch.randn(b, n, d, generator=g)
    target = torch.randn(b, n, d, generator=g)
    weight = torch.randn(vocab, d, generator=g)
    ids = torch.randint(0, vocab, (b, n), generator=g)
    mask = torch.rand(b, n, generator=g) > 0.4
    return pred, target, weight, ids, mask


def test_loss_terms_match_a_direct_computation():
    pred, target, weight, ids, mask = _random_case()
    terms = eagle_loss(pred, target, weight, ids, mask, feature_weight=1.0, token_weight=0.1, soft=True)
    p, t = pred[mask], target[mask]
    smooth_l1 = F.smooth_l1_loss(p, t, reduction="none").mean(-1).mean()
    soft_target = torch.softmax(t @ weight.T, -1)
    ce = -(soft_target * torch.log_softmax(p @ weight.T, -1)).sum(-1).mean()
    torch.testing.assert_close(terms["smooth_l1"], smooth_l1)
    torch.testing.assert_close(terms["ce"], ce)
    torch.testing.assert_close(terms["loss"], smooth_l1 + 0.1 * ce)
    hard = eagle_loss(pred, target, weight, ids, mask, soft=False)
    torch.testing.assert_close(hard["ce"], F.cross_entropy(p @ weight.T, ids[mask]))


def test_masked_positions_do_not_matter():
    pred, target, weight, ids, mask = _random_case(1)
    base = eagle_loss(pred, target, weight, ids, mask)
    pred2 = pred.clone()
    pred2[~mask] = 1e3  # garbage outside the mask
    torch.testing.assert_close(eagle_loss(pred2, target, weight, ids, mask)["loss"], base["loss"])


def test_global_normalisation_makes_split_batches_equal_to_one_batch():
    pred, target, weight, ids, mask = _random_case(2, b=4)
    whole = eagle_loss(pred, target, weight, ids, mask)["loss"]
    halves = [
        eagle_loss_sums(pred[s], target[s], weight, ids[s], mask[s]) for s in (slice(0, 1), slice(1, 4))
    ]
    total_tokens = sum(h["tokens"] for h in halves)
    split = sum(combine_terms(h, total_tokens)["loss"] for h in halves)
    torch.testing.assert_close(split, whole)


def test_soft_ce_target_is_detached():
    pred, target, weight, ids, mask = _random_case(3)
    pred.requires_grad_(True)
    target.requires_grad_(True)
    eagle_loss(pred, target, weight, ids, mask, feature_weight=0.0)["loss"].backward()
    assert pred.grad[mask].abs().sum() > 0
    assert torch.count_nonzero(target.grad) == 0  # the target's distribution is a constant


def test_uniform_noise_is_bounded_and_reproducible():
    x = torch.zeros(2, 50, 16)
    a = add_feature_noise(x, "uniform", 0.1, torch.Generator().manual_seed(0))
    b = add_feature_noise(x, "uniform", 0.1, torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    assert a.abs().max() <= 0.1 and a.abs().max() > 0.09
    assert a.mean().abs() < 0.01


def test_length_scaled_noise_follows_the_reference_formula():
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(1, 1023, 8)  # a sequence of 1024 tokens has 1023 head positions
    noisy = add_feature_noise(x, "length_scaled", 0.1, g)
    u = torch.rand(x.shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(noisy, (u - 0.5) * 0.2 * 512 / 1024)


def test_length_scaled_noise_uses_each_sequences_own_length():
    """In a padded batch, a 100-token sequence gets amplitude 0.1 * 512 / 100 and a 400-token one
    0.1 * 512 / 400, as the reference (per sample) draws them; not the padded batch length's."""
    x = torch.zeros(2, 399, 64)
    noisy = add_feature_noise(
        x, "length_scaled", 0.1, torch.Generator().manual_seed(0), torch.tensor([100, 400])
    )
    short, long = noisy[0, :99].abs().max(), noisy[1].abs().max()
    assert 0.5 < short <= 0.512 and 0.125 < long <= 0.128
    u = torch.rand(x.shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(noisy[0], (u[0] - 0.5) * 0.2 * 512 / 100)


def test_no_noise_returns_the_input():
    x = torch.randn(2, 3, 4)
    assert add_feature_noise(x, "none") is x
    with pytest.raises(ValueError, match="noise mode"):
        add_feature_noise(x, "gaussian")


# ---------------------------------------------------------------- EAGLE-3: the training-time test


def test_ttt_steps_shift_inputs_targets_and_mask_by_hand():
    """The sequence of the EAGLE-1 example, unrolled: at step k column j is fed t_{j+1+k}, predicts
    t_{j+2+k} from lm_head(f_{j+1+k}) and is trained iff that token is a reply token."""
    tokens = torch.tensor([10, 11, 12, 20, 21, 22])
    mask = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool)
    hidden = torch.arange(6, dtype=torch.float32)[:, None].expand(6, 4)
    s = {k: v[None] for k, v in shift_sequence(tokens, mask, hidden, aux=hidden.repeat(1, 3) + 100).items()}
    assert s["features"][0, :, 0].tolist() == [100, 101, 102, 103, 104]  # EAGLE-3 is fed a_j
    expected = {
        # step: (input token t_{j+1+k}, feature index of the target distribution j+1+k, token t_{j+2+k}, mask)
        0: ([11, 12, 20, 21, 22], [1, 2, 3, 4, 5], [12, 20, 21, 22, 0], [0, 1, 1, 1, 0]),
        1: ([12, 20, 21, 22, 0], [2, 3, 4, 5, 0], [20, 21, 22, 0, 0], [1, 1, 1, 0, 0]),
        2: ([20, 21, 22, 0, 0], [3, 4, 5, 0, 0], [21, 22, 0, 0, 0], [1, 1, 0, 0, 0]),
        4: ([22, 0, 0, 0, 0], [5, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]),
    }
    for k, (inputs, features, targets, trained) in expected.items():
        assert shift_left(s["input_ids"], k, 0)[0].tolist() == inputs
        assert shift_left(s["target_hidden"], k, 0.0)[0, :, 0].tolist() == features
        assert shift_left(s["target_ids"], k, 0)[0].tolist() == targets
        assert shift_left(s["loss_mask"], k, False)[0].int().tolist() == trained
        # every trained column predicts the reply token that follows its input token in the sequence
        for j in torch.nonzero(torch.tensor(trained)).flatten().tolist():
            position = 2 + j + k  # sequence index of the predicted token
            assert tokens[position] == targets[j] and tokens[position - 1] == inputs[j] and mask[position]


def _ttt_case(seed=0, b=2, n=7, d=8, vocab=11):
    g = torch.Generator().manual_seed(seed)
    kept = torch.tensor([0, 2, 3, 5, 8, 9])
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    case = {
        "hidden": torch.randn(b, n, d, generator=g),
        "target_hidden": torch.randn(b, n, d, generator=g),
        "weight": torch.randn(vocab, d, generator=g),
        "draft_head": torch.randn(len(kept), d, generator=g),
        "labels": torch.randint(0, vocab, (b, n), generator=g),
        "mask": torch.rand(b, n, generator=g) > 0.3,
    }
    return case, kept, t2d


def test_ttt_loss_restricts_the_target_to_the_draft_vocabulary():
    case, kept, t2d = _ttt_case()
    greedy = (case["target_hidden"] @ case["weight"].T).argmax(-1)
    probs = ttt_target_probs(case["target_hidden"], case["weight"][kept], case["mask"] & t2d[case["labels"]])
    sums = ttt_loss_sums(
        case["hidden"], lambda h: h @ case["draft_head"].T, probs, kept, t2d, case["labels"], greedy, case["mask"],
    )  # fmt: skip
    ce, correct, tokens = 0.0, 0, 0
    for b in range(2):
        for j in range(7):
            if not case["mask"][b, j]:
                continue
            draft_logits = case["draft_head"] @ case["hidden"][b, j]
            correct += int(kept[draft_logits.argmax()] == greedy[b, j])  # mapped to a target id
            if case["labels"][b, j] not in kept:  # its token is outside the draft vocabulary: no loss
                continue
            p = torch.softmax((case["weight"] @ case["target_hidden"][b, j])[kept], 0)
            ce -= float((p * torch.log_softmax(draft_logits, 0)).sum())
            tokens += 1
    assert 0 < tokens < int(case["mask"].sum())  # the case has kept and dropped positions
    assert sums["ce"].item() == pytest.approx(ce, rel=1e-5)
    assert sums["correct"] == correct and sums["tokens"] == tokens and sums["positions"] == case["mask"].sum()
    hard = ttt_loss_sums(
        case["hidden"], lambda h: h @ case["draft_head"].T, None, kept, t2d, case["labels"], greedy, case["mask"],
        soft=False,
    )  # fmt: skip
    trainable = case["mask"] & t2d[case["labels"]]
    draft_index = {int(t): i for i, t in enumerate(kept)}
    expected = F.cross_entropy(
        case["hidden"][trainable] @ case["draft_head"].T,
        torch.tensor([draft_index[int(t)] for t in case["labels"][trainable]]),
        reduction="sum",
    )
    torch.testing.assert_close(hard["ce"], expected)


def test_ttt_total_weights_step_k_by_decay_to_the_k():
    total = combine_ttt_terms([torch.tensor(6.0), torch.tensor(4.0), torch.tensor(9.0)], [3, 2, 0], 0.8)
    assert total["loss"].item() == pytest.approx(2.0 + 0.8 * 2.0 + 0.64 * 9.0)  # no tokens: clamped to 1
    assert total["ce_step2"].item() == pytest.approx(2.0)


def one_shot_ce(pred, target, weight, ids, soft=True):
    """The CE over all positions at once (what the chunked loss must equal), float64."""
    logp = torch.log_softmax(pred.double() @ weight.double().T, -1)
    if soft:
        return -(torch.softmax(target.double() @ weight.double().T, -1) * logp).sum()
    return F.nll_loss(logp, ids, reduction="sum")


@pytest.mark.parametrize("soft", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_ce_equals_the_one_shot_value_and_gradient(soft, chunk):
    """Chunks of 1, 3 (uneven: 9 positions) and one chunk for all give the same CE, top-1 count and
    gradient w.r.t. the predicted features as the one-shot computation."""
    pred, target, weight, ids, mask = _random_case(4, b=3, n=5, vocab=13)
    pred = pred.double().requires_grad_(True)
    sums = eagle_loss_sums(pred, target.double(), weight.double(), ids, mask, soft, chunk=chunk)
    sums["ce"].backward()
    chunked_grad = pred.grad.clone()
    pred.grad = None
    p, t = pred[mask], target.double()[mask]
    reference = one_shot_ce(p, t, weight, ids[mask], soft)
    reference.backward()
    torch.testing.assert_close(sums["ce"].double(), reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked_grad, pred.grad, rtol=1e-5, atol=1e-6)  # float32 inside
    top1 = ((p @ weight.double().T).argmax(-1) == (t @ weight.double().T).argmax(-1)).sum()
    assert int(sums["correct"]) == int(top1)


def test_loss_memory_is_flat_in_sequence_length():
    """Peak memory of the loss (forward + backward) over 512 vs 4096 positions, vocabulary 4096: it
    grows only by the [positions, hidden] tensors, never by a [positions, vocab] one (a single
    [3584, 4096] float32 tensor is 56 MiB; the one-shot loss held several)."""
    from eagle_train.diagnostics.gpu_checks import loss_peak

    vocab, hidden = 4096, 32
    short, long = (loss_peak(n, vocab, hidden, "cpu", torch.float32, chunk=128) for n in (512, 4096))
    per_position_vocab = (4096 - 512) * vocab * 4
    assert long - short < 32 * (4096 - 512) * hidden * 4  # a few [positions, hidden] float32 tensors
    assert long - short < per_position_vocab / 4
    assert long < 16 * 128 * vocab * 4  # a few [chunk, vocab] tensors at most
