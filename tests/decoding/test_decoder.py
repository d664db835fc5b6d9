"""The decoder on the real stories260K target: greedy speculative output == autoregressive output
token for token (chain, static and dynamic trees; random and trained heads; across EOS and the
context limit), the round's first token is the target's own, and lossless sampling on real
next-token distributions (chi-square, fixed seeds, rejected below p = 1e-3)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from eagle_train.config.decode import DecodeConfig
from eagle_train.decoding.decoder import Round, SpeculativeDecoder, record_rounds
from eagle_train.decoding.drafter import Drafter
from eagle_train.decoding.expand import expand_dynamic, expand_static, plan_static
from eagle_train.decoding.stats import GenerationStats
from eagle_train.decoding.tree import build_tree, shape_from_paths
from eagle_train.decoding.verify import accept_sampling, process_logits
from eagle_train.modeling.hf_generate import HFGenerate
from eagle_train.modeling.target import load_target
from tests.chi_square import chi_square_p
from tests.conftest import DATA

SPEC = {
    "chain": DecodeConfig(method="chain", chain_length=4),
    "eagle1": DecodeConfig(method="static_tree", tree="mc_sim_7b_63"),
    "eagle2": DecodeConfig(method="dynamic_tree", depth=3, top_k=4, total_tokens=16),
}


def prompts(target, n: int = 2) -> list[list[int]]:
    lines = (DATA / "tinystories" / "tinystories_prompts.jsonl").read_text().splitlines()[:n]
    return [target.tokenizer(json.loads(line)["prompt"])["input_ids"] for line in lines]


def generate(target, head, cfg: DecodeConfig, prompt, **overrides):
    cfg = replace(cfg, **overrides)
    decoder = HFGenerate(target, cfg) if cfg.method == "hf" else SpeculativeDecoder(target, head, cfg)
    return decoder.generate(prompt)


HEADS = [
    "random_head",
    "trained_head",
    "random_eagle3_head",
    pytest.param("trained_eagle3_head", marks=pytest.mark.quick),
    "random_peagle_head",
    pytest.param("trained_peagle_head", marks=pytest.mark.quick),
]


@pytest.mark.slow
@pytest.mark.parametrize("head_kind", HEADS)
@pytest.mark.parametrize("method", sorted(SPEC))
def test_greedy_speculative_equals_autoregressive(request, target, method, head_kind):
    """EAGLE-1/2, EAGLE-3 and P-EAGLE heads (the latter two: aux features, a 256-token draft vocabulary
    mapped to target ids; P-EAGLE: every tree from one forward's per-depth distributions) in every tree:
    plain decoding's tokens, and trained heads are accepted."""
    head = request.getfixturevalue(head_kind)
    for prompt in prompts(target):
        ar = generate(target, None, DecodeConfig(method="ar"), prompt, max_new_tokens=100)
        result = generate(target, head, SPEC[method], prompt, max_new_tokens=100)
        assert result.tokens == ar.tokens and result.stop_reason == ar.stop_reason
        assert sum(a + 1 for a in result.stats.accepted_per_round) + 1 >= len(result.tokens)
        if head_kind.startswith("trained"):  # a trained head must actually be accepted
            assert result.stats.tau > 1.3


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(SPEC))
def test_a_peagle_head_drafts_a_round_in_one_forward_and_keeps_the_models_own_output(
    target, trained_peagle_head, trained_eagle3_head, method, monkeypatch
):
    """The model's own output (Hugging Face `generate`), token for token, with every draft of a round
    from ONE draft forward: the catch-up carries the placeholders (an EAGLE-3 head's chain of 4 takes
    its catch-up plus one forward per depth)."""
    forwards = []
    original = Drafter._forward

    def counting(self, *args, **kwargs):
        forwards.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Drafter, "_forward", counting)
    for prompt in prompts(target):
        hf = generate(target, None, DecodeConfig(method="hf"), prompt, max_new_tokens=100)
        for head, one_forward in ((trained_peagle_head, True), (trained_eagle3_head, False)):
            forwards.clear()
            result = generate(target, head, SPEC[method], prompt, max_new_tokens=100)
            assert result.tokens == hf.tokens and result.stats.tau > 1.3
            assert (len(forwards) <= result.stats.rounds + 1) == one_forward, (method, len(forwards))


@pytest.mark.slow
@pytest.mark.parametrize("head_kind", ["trained_head", "trained_eagle3_head", "trained_peagle_head"])
def test_stops_at_eos_like_autoregressive(request, target, head_kind):
    """A story ends with the stop id 1: every method stops on it, at the same token."""
    head = request.getfixturevalue(head_kind)
    prompt = target.tokenizer("Once upon a time, there was a cat. The cat was happy. The end.")["input_ids"]
    ar = generate(target, None, DecodeConfig(method="ar"), prompt, max_new_tokens=400)
    assert ar.stop_reason == "stop_token" and ar.tokens[-1] in target.stop_token_ids
    for cfg in SPEC.values():
        result = generate(target, head, cfg, prompt, max_new_tokens=400)
        assert result.tokens == ar.tokens and result.stop_reason == "stop_token"


@pytest.mark.slow
def test_context_limit_like_autoregressive(
    target, target_cfg, random_head, trained_head, trained_eagle3_head, trained_peagle_head
):
    short = replace(target, cfg=replace(target_cfg, max_len=40))
    prompt = prompts(target, 1)[0]
    ar = generate(short, None, DecodeConfig(method="ar"), prompt, max_new_tokens=500)
    assert ar.stop_reason == "context" and len(prompt) + len(ar.tokens) == 40
    for head in (random_head, trained_head, trained_eagle3_head, trained_peagle_head):
        for cfg in SPEC.values():
            assert generate(short, head, cfg, prompt, max_new_tokens=500).tokens == ar.tokens
    hf = generate(short, None, DecodeConfig(method="hf"), prompt, max_new_tokens=500)
    assert hf.tokens == ar.tokens


@pytest.mark.slow
def test_no_dynamic_round_one_step_before_the_context_limit(target, target_cfg, random_head, monkeypatch):
    """One draft position before the context limit no EAGLE-2 tree fits (it is depth + 1 >= 2 deep): the
    decoder finishes plainly instead of expanding with depth 0 (whose parents are corrupt), and the
    output still equals plain decoding up to the limit."""
    import eagle_train.decoding.decoder as decoder

    depths = []

    def recording(root, root_logp, drafter, depth, top_k, total_tokens, vocab_map=None):
        depths.append(depth)
        return expand_dynamic(root, root_logp, drafter, depth, top_k, total_tokens, vocab_map)

    monkeypatch.setattr(decoder, "expand_dynamic", recording)
    prompt = prompts(target, 1)[0]
    for limit in range(len(prompt) + 3, len(prompt) + 12):  # every parity of where the rounds end
        short = replace(target, cfg=replace(target_cfg, max_len=limit))
        ar = generate(short, None, DecodeConfig(method="ar"), prompt, max_new_tokens=500)
        result = generate(short, random_head, SPEC["eagle2"], prompt, max_new_tokens=500)
        assert result.tokens == ar.tokens and result.stop_reason == "context"
    assert depths and min(depths) >= 1
    with pytest.raises(ValueError, match="depth >= 1"):
        expand_dynamic(0, torch.zeros(8), lambda *a: torch.zeros(1, 8), 0, 2, 4)


@pytest.mark.slow
def test_hf_generate_and_max_new_tokens(target):
    prompt = prompts(target, 1)[0]
    ar = generate(target, None, DecodeConfig(method="ar"), prompt, max_new_tokens=40)
    hf = generate(target, None, DecodeConfig(method="hf"), prompt, max_new_tokens=40)
    assert ar.tokens == hf.tokens and len(ar.tokens) == 40 and ar.stop_reason == "max_new_tokens"


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_round_starts_with_the_targets_own_token(target, trained_head, temperature):
    """Measured: the first token of every round (the root, drawn from the target's distribution) is
    always emitted; greedy: it is the target's argmax given everything before it. Sampling (top-k 5):
    every emitted token, roots and accepted drafts alike, lies in the target's top 5 at its position
    (a verifier that let a draft token through unchecked would emit the draft's picks outside it)."""
    prompt = prompts(target, 1)[0]
    res = generate(
        target,
        trained_head,
        SPEC["eagle2"],
        prompt,
        max_new_tokens=60,
        temperature=temperature,
        top_k_sampling=5,
    )
    starts = [0]
    for a in res.stats.accepted_per_round:
        starts.append(starts[-1] + a + 1)
    roots = [s for s in starts if s < len(res.tokens)]
    assert len(roots) == res.stats.rounds + (1 if starts[-1] < len(res.tokens) else 0)
    seq = torch.tensor(prompt + res.tokens)[None]
    logits, _ = target.features(seq)
    positions = logits[0, len(prompt) - 1 : len(prompt) - 1 + len(res.tokens)]  # [new, vocab]
    if temperature == 0:
        assert [res.tokens[s] for s in roots] == [int(positions[s].argmax()) for s in roots]
    else:
        top5 = positions.topk(5, dim=-1).indices  # [new, 5]
        assert all(token in top5[i].tolist() for i, token in enumerate(res.tokens))
        assert res.stats.rounds > 0 and sum(res.stats.accepted_per_round) > 0  # drafts were accepted too
    rates = res.stats.acceptance_by_position
    assert all(r is None or 0.0 <= r <= 1.0 for r in rates) and len(res.stats.node_confidence) == len(
        res.stats.node_accepted
    )


def test_round_statistics_per_node():
    """The per-round and per-node statistics gathered once per generation equal a round-by-round walk
    (roots excluded, accepted flags on the path's nodes, deepest node per round)."""
    trees = [
        build_tree(torch.arange(5), [-1, 0, 0, 1, 3]),
        build_tree(torch.arange(3), [-1, 0, 1]),
        build_tree(torch.arange(4), [-1, 0, 0, 2]),
    ]
    for i, tree in enumerate(trees):
        tree.confidence = torch.linspace(0.1, 0.9, tree.size) + i
    paths = [[0, 1, 3], [0], [0, 2, 3]]
    stats = GenerationStats()
    record_rounds(
        [Round(t, p, [0] * len(p), torch.zeros(len(p), 1)) for t, p in zip(trees, paths, strict=True)], stats
    )
    assert stats.rounds == 3 and stats.accepted_per_round == [2, 0, 2]
    assert stats.tree_size_per_round == [5, 3, 4] and stats.tree_depth_per_round == [3, 2, 2]
    depth, accepted, confidence = [], [], []
    for tree, path in zip(trees, paths, strict=True):
        depth += tree.depth[1:].tolist()
        accepted += [i in path for i in range(1, tree.size)]
        confidence += tree.confidence[1:].tolist()
    assert stats.node_depth == depth == [1, 1, 2, 3, 1, 2, 1, 1, 2]
    assert stats.node_accepted == accepted
    assert stats.node_confidence == pytest.approx(confidence)


@torch.inference_mode()  # as in the decoder: the drafter has no autograd context of its own
def joint_counts(target, head, sample_children: bool, runs: int, seed: int):
    """Counts of the first two tokens after a fixed root on a real prompt, emitted by one verification
    round (then continued from the target), with top-k 6 sampling at temperature 1. An EAGLE-3 head
    drafts from the target's aux features over its draft vocabulary (mapped through its vocab_map)."""
    process = lambda lg: process_logits(lg, 1.0, 1.0, 6)  # noqa: E731
    prompt = torch.tensor(prompts(target, 1)[0])
    logits, feats = target.features(prompt[None])
    if head.aux_layers is not None:
        _, feats = target.aux_hidden_states(prompt[None], None, head.aux_layers)
    root = int(logits[0, -1].argmax())
    paths = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]
    plan = plan_static(shape_from_paths(paths))
    parallel = plan.shape.max_depth - 1 if getattr(head, "kind", "") == "peagle" else 0  # P-EAGLE's slots
    drafter = Drafter(head, target.max_len, plan.shape.size, GenerationStats(), parallel=parallel)
    root_lp = drafter.catch_up(torch.cat([prompt[1:], torch.tensor([root])]), feats[0])
    g = torch.Generator().manual_seed(seed)
    memo: dict[tuple[int, ...], torch.Tensor] = {}

    def p_after(ctx: tuple[int, ...]) -> torch.Tensor:
        if ctx not in memo:
            seq = torch.cat([prompt, torch.tensor([root, *ctx])])[None]
            memo[ctx] = process(target.features(seq)[0][0, -1])
        return memo[ctx]

    counts = torch.zeros(target.vocab_size, target.vocab_size)
    tree = None
    for _ in range(runs):
        if tree is None or sample_children:
            drafter.cache.crop(drafter.committed)
            drafter.fed = 0
            tree = expand_static(
                plan,
                root,
                root_lp,
                drafter,
                (lambda lp: process(lp)) if sample_children else None,
                g,
                head.vocab_map,
            )
            node_ctx = [
                tuple(tree.tokens[[j for j in row if j >= 0][1:]].tolist()) for row in _node_paths(tree)
            ]
            probs = torch.stack([p_after(c) for c in node_ctx])
        path, bonus = accept_sampling(tree, probs, g)
        out = [int(tree.tokens[i]) for i in path[1:]] + [bonus]
        if len(out) < 2:
            out.append(int(torch.multinomial(p_after(tuple(out)), 1, generator=g)))
        counts[out[0], out[1]] += 1
    exact = torch.stack([p_after(())[a] * p_after((a,)) for a in range(target.vocab_size)])
    return counts, exact


def _node_paths(tree):
    paths, parents = [], tree.parents.tolist()
    for i in range(tree.size):
        paths.append([*paths[parents[i]], i] if i else [0])
    return paths


@pytest.mark.slow
@pytest.mark.parametrize(
    "head_kind",
    [pytest.param("trained_head", marks=pytest.mark.quick), "trained_eagle3_head", "trained_peagle_head"],
)
@pytest.mark.parametrize("sample_children", [False, True])
def test_sampling_is_lossless_on_stories260k(request, target, head_kind, sample_children):
    """The EAGLE-3 head's q lives on its 256-token draft vocabulary, the target's top-6 support does not:
    the first two emitted tokens still follow the target's joint distribution."""
    head = request.getfixturevalue(head_kind)
    counts, exact = joint_counts(target, head, sample_children, runs=3000, seed=7)
    support = exact.flatten() > 0
    assert counts.flatten()[~support].sum() == 0  # nothing outside the target's top-k support
    assert chi_square_p(counts.flatten()[support].numpy(), exact.flatten()[support].numpy()) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("head_kind", ["trained_head", "trained_eagle3_head", "trained_peagle_head"])
def test_sampling_decoder_runs_and_stops(request, target, head_kind):
    head = request.getfixturevalue(head_kind)
    prompt = prompts(target, 1)[0]
    for cfg in SPEC.values():
        res = generate(target, head, cfg, prompt, max_new_tokens=50, temperature=0.8, top_p=0.95, seed=3)
        assert 0 < len(res.tokens) <= 50 and all(0 <= t < target.vocab_size for t in res.tokens)
        again = generate(target, head, cfg, prompt, max_new_tokens=50, temperature=0.8, top_p=0.95, seed=3)
        assert again.tokens == res.tokens  # the seeded generator makes a run reproducible


@pytest.mark.slow
def test_stop_strings_like_autoregressive(target, trained_head):
    prompt = prompts(target, 1)[0]
    ar = generate(target, None, DecodeConfig(method="ar"), prompt, max_new_tokens=100, stop_strings=["tree"])
    assert ar.stop_reason == "stop_string" and "tree" in target.tokenizer.decode(ar.tokens)
    assert "tree" not in target.tokenizer.decode(ar.tokens[:-1])
    for cfg in SPEC.values():
        result = generate(target, trained_head, cfg, prompt, max_new_tokens=100, stop_strings=["tree"])
        assert result.tokens == ar.tokens and result.stop_reason == "stop_string"


@pytest.mark.gpu
def test_greedy_identity_on_cuda(target_cfg, trained_head):
    """The decoder's promise on a GPU (skipped without CUDA): every method equals plain decoding."""
    from eagle_train.modeling.target import load_target

    cuda_target = load_target(target_cfg, "cuda")
    head = trained_head.to("cuda")
    try:
        prompt = prompts(cuda_target, 1)[0]
        ar = generate(cuda_target, None, DecodeConfig(method="ar"), prompt, max_new_tokens=64)
        for cfg in SPEC.values():
            assert generate(cuda_target, head, cfg, prompt, max_new_tokens=64).tokens == ar.tokens
    finally:
        trained_head.to("cpu")


def test_compiled_decoder_takes_the_cpp_wrapper_on_a_cpu(target):
    """target.compile_cpp_wrapper: null (the default) is inductor's C++ wrapper on a CPU target; true / false
    force it either way (test_compiled_decode_equals_stock decodes through the default)."""
    assert target.cfg.compile_cpp_wrapper is None
    assert target.compile_options == {"cpp_wrapper": True}
    for forced in (True, False):
        pinned = replace(target, cfg=replace(target.cfg, compile_cpp_wrapper=forced))
        assert pinned.compile_options == {"cpp_wrapper": forced}


@pytest.mark.slow
def test_compiled_decode_equals_stock(target, target_cfg, trained_head):
    """target.compile_decode (on this CPU through inductor's C++ wrapper): the compiled decoder's logits and
    features on a tree equal the stock forward's, and greedy EAGLE-2 on it (and the ar baseline on it) is
    plain decoding's output token for token. Minutes: two graphs (one-token steps, the rest) are compiled."""
    compiled = load_target(replace(target_cfg, compile_decode=True))
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 500, (1, 11), generator=g)
    tree = build_tree(torch.randint(3, 500, (7,), generator=g), [-1, 0, 0, 1, 1, 2, 4])
    mask = torch.cat([torch.ones(7, 11, dtype=torch.bool), tree.attention_mask], dim=1)[None, None]
    outputs = []
    with torch.inference_mode():  # as the decoder runs it: the graphs compiled here are the ones it reuses
        for model in (target, compiled):
            cache = model.new_cache(32)
            model.decode(
                prefix, torch.arange(11)[None], torch.ones(11, 11, dtype=torch.bool).tril()[None, None], cache
            )
            cache.advance(11)
            outputs.append(model.decode(tree.tokens[None], (tree.depth + 11)[None], mask, cache))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    for prompt in prompts(target):
        ar = generate(target, None, DecodeConfig(method="ar"), prompt, max_new_tokens=60)
        assert (
            generate(compiled, None, DecodeConfig(method="ar"), prompt, max_new_tokens=60).tokens == ar.tokens
        )
        result = generate(compiled, trained_head, SPEC["eagle2"], prompt, max_new_tokens=60)
        assert result.tokens == ar.tokens and result.stats.tau > 1.3
