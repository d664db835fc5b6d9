"""The speculative decoder: chain, EAGLE-1 static tree and EAGLE-2 dynamic tree, plus plain decoding.

Public API (batch size 1):

    from eagle_train.config.decode import DecodeConfig
    from eagle_train.decoding.decoder import SpeculativeDecoder

    decoder = SpeculativeDecoder(target, head, DecodeConfig(method="dynamic_tree", depth=4, top_k=4, total_tokens=16))
    result = decoder.generate(prompt_ids)          # list[int] or LongTensor [seq] / [1, seq]
    result.tokens                                   # generated ids (stop token included), list[int]
    result.stop_reason                              # "stop_token" | "stop_string" | "max_new_tokens" | "context"
    result.stats.tau, result.stats.acceptance_by_position, result.stats.to_dict()

`target` is any `TargetModel` (the stock HF model behind `eagle_train.modeling.target.Target`: `decode`
on a static KV cache); `head` a `DraftModel` (`DraftHead` with the target's embedding / LM head shared,
or `Eagle3Head`: it reads the target's aux features, which `decode` returns for its `aux_layers`, and
drafts over a reduced vocabulary, its ids mapped to target ids through `vocab_map`; None for `ar`).
Methods: `ar` plain decoding in this harness (same cache code, one target forward per
token), `chain`, `static_tree` (the static tree `cfg.tree_paths`), `dynamic_tree` (dynamic tree). The method is
chosen once, at construction. A P-EAGLE head (`PEagleHead`) drafts every method's tree in ONE draft forward
per round (the catch-up with its placeholders, `decoding.drafter`): `chain` is the chain vLLM drafts with
`parallel_drafting`, `static_tree` / `dynamic_tree` trees built from the same forward's per-depth distributions.
A DFlash head (`DFlashHead`, `drafts_block`) drafts a chain of min(chain_length, B - 1) tokens per round from
ONE forward of the block [root, MASK x (B-1)] over its cached context (`decoding.drafter.BlockDrafter`);
it runs `chain` only. temperature 0 = greedy: the output equals `ar` token for token (in float32;
below it, up to near-ties: `decoding.identity`);
temperature > 0: lossless rejection sampling (`decoding.verify`), the output is distributed as the
target's. Hugging Face `generate`, the second baseline, lives outside this pure decoder
(`eagle_train.modeling.hf_generate`).

Generation stops at a stop token (`TargetModel.stop_token_ids`), a stop string, max_new_tokens, or when the
sequence reaches the context limit `TargetModel.max_len` (prompt + generated <= max_len).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from eagle_train.config.decode import SPECULATIVE, DecodeConfig, block_chain_length
from eagle_train.decoding.drafter import BlockDrafter, Drafter
from eagle_train.decoding.expand import expand_dynamic, expand_parallel, expand_static, plan_static
from eagle_train.decoding.kv_cache import StaticKVCache
from eagle_train.decoding.stats import GenerationStats
from eagle_train.decoding.timing import PhaseTimer
from eagle_train.decoding.tree import Tree, chain_paths, shape_from_paths
from eagle_train.decoding.verify import accept_greedy, accept_sampling, process_logits


class TargetModel(Protocol):
    """What the decoder needs from the target (eagle_train.modeling.target.Target provides it)."""

    device: torch.device
    max_len: int  # the context limit: prompt + generated tokens
    stop_token_ids: list[int]
    tokenizer: Any  # decodes ids for stop strings

    def new_cache(self, capacity: int) -> StaticKVCache: ...

    def decode(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: StaticKVCache,
        aux_layers: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # (logits [1, q, vocab], features [1, q, hidden or 3 hidden])


class DraftModel(Protocol):
    """What the decoder needs from a draft head (eagle_train.modeling.draft.DraftHead and
    eagle_train.modeling.eagle3.Eagle3Head provide it)."""

    config: Any  # Llama config: hidden size, attention shape, layers
    aux_layers: list[int] | None  # the target layers whose inputs it reads; None: the last hidden state
    vocab_map: torch.Tensor | None  # [draft_vocab] target id of each draft id; None: logits over the target's

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    def __call__(
        self, input_ids, features, position_ids=None, attention_mask=None, cache=None
    ) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass
class GenerationResult:
    """Generated token ids (the prompt excluded), why generation stopped, and its statistics."""

    tokens: list[int]
    stop_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)


class StopRules:
    """The generated tokens and every stop rule, applied token by token (as plain decoding would)."""

    def __init__(self, cfg: DecodeConfig, prompt_len: int, max_len: int, stop_ids: list[int], tokenizer):
        self.tokens: list[int] = []
        self.max_new = cfg.max_new_tokens
        self.limit = min(cfg.max_new_tokens, max_len - prompt_len)
        self.stop_ids, self.stop_strings, self.tokenizer = set(stop_ids), list(cfg.stop_strings), tokenizer
        self.window = max((len(s) for s in self.stop_strings), default=0) + 8
        self.reason: str | None = None

    def extend(self, new: list[int]) -> bool:
        """Append tokens until a stop rule fires; True once generation is over."""
        for token in new:
            self.tokens.append(token)
            if token in self.stop_ids:
                self.reason = "stop_token"
            elif self.stop_strings and self._has_stop_string():
                self.reason = "stop_string"
            elif len(self.tokens) >= self.limit:
                self.reason = "max_new_tokens" if self.limit == self.max_new else "context"
            if self.reason is not None:
                return True
        return False

    def _has_stop_string(self) -> bool:
        text = self.tokenizer.decode(self.tokens[-self.window :])
        return any(s in text for s in self.stop_strings)


@dataclass
class Round:
    """One verified round: the tree, its accepted node path, the emitted tokens (accepted drafts + the
    bonus token) and the target's features of the path's nodes [len(path), hidden]."""

    tree: Tree
    path: list[int]
    emitted: list[int]
    features: torch.Tensor


class SpeculativeDecoder:
    """Decode with a target and a draft head according to a `DecodeConfig` (see the module docstring)."""

    def __init__(self, target: TargetModel, head: DraftModel | None, cfg: DecodeConfig):
        if cfg.method not in ("ar", *SPECULATIVE):
            raise ValueError(f"SpeculativeDecoder runs ar and {', '.join(SPECULATIVE)}, not {cfg.method!r}")
        if cfg.speculative and head is None:
            raise ValueError(f"decode.method={cfg.method!r} needs a draft head")
        if cfg.method in cfg.auto_methods:
            raise ValueError(
                f"decode.shape=auto / decode.tree=auto: {cfg.method}'s shape is chosen from measured costs "
                "before decoding (eagle_train.autotune.shapes.tune_shapes, as the evaluate stage does); give "
                "the decoder the chosen fields, or decode.shape=fixed / decode.tree=NAME"
            )
        if cfg.method in ("static_tree", "dynamic_tree") and getattr(head, "drafts_block", False):
            raise ValueError(
                f"decode.method={cfg.method}: a {head.kind} head drafts a chain (decode.method=chain): trees "
                "from its block's per-slot distributions are not built"
            )
        self.target, self.head, self.cfg = target, head, cfg
        self.device = target.device
        self.aux_layers, self.vocab_map = head_reads(head, self.device)
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self._expand: Callable[[int, torch.Tensor, Drafter, int], Tree] | None = None
        self.tree_nodes, self.tree_inputs = 1, 0  # most nodes verified / draft inputs fed per round
        self.min_room = 1  # draft positions a round needs before the context limit
        if cfg.method in ("chain", "static_tree"):
            paths = (
                chain_paths(chain_depth(head, cfg.chain_length)) if cfg.method == "chain" else cfg.tree_paths
            )
            self.shape = shape_from_paths(paths)
            self._plans = {self.shape.max_depth: plan_static(self.shape, self.device)}
            self.tree_nodes = self.tree_inputs = self.shape.size
            self._expand = self._expand_static
        elif cfg.method == "dynamic_tree":
            self.tree_nodes, self.tree_inputs = cfg.total_tokens, cfg.top_k * cfg.depth
            self._expand = self._expand_dynamic
            self.min_room = 2  # the dynamic tree is depth + 1 deep with depth >= 1
        depth = 0  # ar: no draft forward
        if cfg.speculative:
            depth = self.shape.max_depth if cfg.method in ("chain", "static_tree") else cfg.depth + 1
        self.parallel = parallel_slots(head, depth)  # P-EAGLE's placeholders per draft forward
        self._drafter: Drafter | BlockDrafter | None = None  # kept across generations (buffers, weights)

    @property
    def sampling(self) -> bool:
        return self.cfg.temperature > 0

    def generate(self, prompt_ids) -> GenerationResult:
        """Generate a continuation of one prompt (token ids)."""
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=self.device).flatten()
        self.max_len = max_len = self.target.max_len  # a property with config lookups: read once
        if not 0 < prompt.numel() < max_len:
            raise ValueError(f"prompt of {prompt.numel()} tokens: must be 1..{max_len - 1} (context limit)")
        stats = GenerationStats(prompt_tokens=prompt.numel())
        out = StopRules(self.cfg, prompt.numel(), max_len, self.target.stop_token_ids, self.target.tokenizer)
        # every phase timed one way (decoding.timing): on CUDA by events, read with one sync at the end
        self.timer = PhaseTimer(stats, self.device)
        start = time.perf_counter()
        with torch.inference_mode():  # cheaper tensor ops than no_grad; nothing here needs autograd
            self._run(prompt, out, stats)
        self.timer.read()
        stats.time_total = time.perf_counter() - start
        stats.new_tokens = len(out.tokens)
        return GenerationResult(tokens=out.tokens, stop_reason=out.reason or "max_new_tokens", stats=stats)

    def _run(self, prompt: torch.Tensor, out: StopRules, stats: GenerationStats) -> None:
        """Prefill, then speculative rounds until a stop rule fires (plain decoding for `ar`, and for the
        last tokens when no draft fits before the context limit)."""
        self.stats = stats
        # room for the prompt, the generated tokens and one tree; allocated once per generation
        self.capacity = prompt.numel() + out.limit + self.tree_nodes
        self.cache = self.target.new_cache(self.capacity)
        # mask rows for one verification forward; a round writes its tree mask into [:q, L:L + q] and restores it
        self.mask = torch.ones(self.tree_nodes, self.capacity, dtype=torch.bool, device=self.device)
        timer = self.timer
        prefill = timer.start()
        root, features = self._prefill(prompt)
        if out.extend([root]):
            timer.stop("time_prefill", prefill)
            return
        if self._expand is None:  # ar
            timer.stop("time_prefill", prefill)
            self._run_ar(root, out)
            return
        drafter = self._new_drafter()
        root_logp = drafter.catch_up(torch.cat([prompt[1:], prompt.new_tensor([root])]), features)
        timer.stop("time_prefill", prefill)
        rounds: list[Round] = []
        try:
            while (done := self._speculate(root, root_logp, drafter)) is not None:
                rounds.append(done)
                if out.extend(done.emitted):
                    return
                root = done.emitted[-1]  # the bonus token: the next round's root
                with timer("time_draft"):
                    root_logp = drafter.catch_up(
                        torch.tensor(done.emitted, device=self.device), done.features
                    )
            self._run_ar(root, out)  # no room left for the method's smallest tree: finish plainly
        finally:
            record_rounds(rounds, stats)

    def _speculate(self, root: int, root_logp: torch.Tensor, drafter: Drafter) -> Round | None:
        """One speculative round: draft a tree below `root` (no deeper than the context allows), verify
        every node with one target forward, keep the accepted path. None when the method's smallest tree
        does not fit (the caller then finishes plainly)."""
        room = self.max_len - 1 - self.cache.seq_len  # draft positions left before the context limit
        if room < self.min_room:
            return None
        with self.timer("time_draft"):
            tree = self._expand(root, root_logp, drafter, room)
        with self.timer("time_verify"):
            logits, features = self._verify_forward(tree)
            path, bonus = self._accept(tree, logits)
            path_features = self._keep_path(path, features)
        tokens = tree.token_list
        return Round(tree, path, [tokens[i] for i in path[1:]] + [bonus], path_features)

    # ---- the method, chosen once ---------------------------------------------------------------------

    def _expand_static(self, root: int, root_logp: torch.Tensor, drafter: Drafter, room: int) -> Tree:
        depth = min(self.shape.max_depth, room)
        if depth not in self._plans:  # near the context limit: the tree cut to the room left
            self._plans[depth] = plan_static(self.shape.truncated(depth), self.device)
        sample = self._draft_probs if self.sampling and self.cfg.sample_children else None
        plan = self._plans[depth]
        if sample is None and drafter.round_logp is not None:  # P-EAGLE: every depth from one top-k
            return expand_parallel(plan, root, drafter.round_logp, self.vocab_map)
        return expand_static(plan, root, root_logp, drafter, sample, self.generator, self.vocab_map)

    def _expand_dynamic(self, root: int, root_logp: torch.Tensor, drafter: Drafter, room: int) -> Tree:
        depth = min(self.cfg.depth, room - 1)  # the tree is depth + 1 deep
        cfg = self.cfg
        return expand_dynamic(root, root_logp, drafter, depth, cfg.top_k, cfg.total_tokens, self.vocab_map)

    def _draft_probs(self, log_probs: torch.Tensor) -> torch.Tensor:
        return process_logits(log_probs, self.cfg.temperature, self.cfg.top_p, self.cfg.top_k_sampling)

    # ---- target side ---------------------------------------------------------------------------------

    def _target_forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, features=True, last=False
    ):
        """(logits [q, vocab], the features the head reads [q, width]); `features=False` (plain decoding
        steps) asks for no aux hidden states; `last`: the last token's logits only ([1, vocab])."""
        start = self.timer.start()
        aux = self.aux_layers if features else None
        logits, hidden = self.target.decode(
            tokens.unsqueeze(0), positions.unsqueeze(0), mask, self.cache, aux, last_logits=last
        )
        self.timer.stop("time_target_forward", start)
        return logits[0], hidden[0]  # [q, vocab], [q, hidden]

    def _choose(self, logits: torch.Tensor) -> int:
        """The target's next token from logits [vocab]: argmax, or a sample from the processed p."""
        if not self.sampling:
            return int(logits.argmax())
        probs = process_logits(logits, self.cfg.temperature, self.cfg.top_p, self.cfg.top_k_sampling)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _prefill(self, prompt: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Target forward over the prompt; returns (first generated token, features [n, hidden])."""
        n = prompt.numel()
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        logits, hidden = self._target_forward(
            prompt, torch.arange(n, device=self.device), causal[None, None], last=True
        )
        self.cache.advance(n)
        return self._choose(logits[-1]), hidden

    def _run_ar(self, token: int, out: StopRules) -> None:
        """Plain decoding from `token` (not yet in the cache) with the same cache code."""
        while True:
            length = self.cache.seq_len
            ids = torch.tensor([token], device=self.device)
            logits, _ = self._target_forward(
                ids, ids.new_tensor([length]), self.mask[None, None, :1, : length + 1], features=False
            )
            self.cache.advance(1)
            token = self._choose(logits[0])
            if out.extend([token]):
                return

    def _verify_forward(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over every tree node (each attends to the prefix and its ancestors, at
        position prefix length + depth). Returns (logits [n, vocab], features [n, hidden])."""
        n, length = tree.size, self.cache.seq_len
        region = self.mask[:n, length : length + n]
        region.copy_(tree.attention_mask)
        logits, features = self._target_forward(
            tree.tokens, tree.depth + length, self.mask[None, None, :n, : length + n]
        )
        region.fill_(True)
        return logits, features

    def _accept(self, tree: Tree, logits: torch.Tensor) -> tuple[list[int], int]:
        """The accepted node path (root first) and the bonus token: greedy or lossless sampling."""
        if not self.sampling:
            return accept_greedy(tree, logits)
        probs = process_logits(logits, self.cfg.temperature, self.cfg.top_p, self.cfg.top_k_sampling)
        return accept_sampling(tree, probs, self.generator)

    def _keep_path(self, path: list[int], features: torch.Tensor) -> torch.Tensor:
        """Commit the path's cache entries (moved next to the prefix unless already there); returns the
        path's features [len(path), hidden]."""
        if path[-1] == len(path) - 1:  # the path is the first nodes (e.g. a chain): already in place
            self.cache.advance(len(path))
            return features[: len(path)]
        kept = torch.tensor(path, device=self.device)
        self.cache.compact(self.cache.seq_len, kept)
        return features.index_select(0, kept)

    def _new_drafter(self) -> Drafter | BlockDrafter:
        """The decoder's drafter, reset for a generation with the current capacity (built on first use:
        the lean forward fuses the head's weights once, so later changes to the head are not seen). A
        DFlash head's: a `BlockDrafter` (no lean forward: one draft forward per round)."""
        if self._drafter is None and getattr(self.head, "drafts_block", False):
            self._drafter = BlockDrafter(self.head, self.capacity, self.stats, self.timer)
        elif self._drafter is None:
            self._drafter = Drafter(
                self.head,
                self.capacity,
                self.tree_inputs,
                self.stats,
                self.cfg.lean_draft,
                timer=self.timer,
                parallel=self.parallel,
            )
        else:
            self._drafter.reset(self.capacity, self.stats, self.timer)
        return self._drafter


def parallel_slots(head: DraftModel | None, tree_depth: int) -> int:
    """A head's placeholders per draft forward for trees up to `tree_depth` deep (a chain of K: K; dynamic_tree:
    depth + 1) when it drafts in its catch-up (P-EAGLE: `drafts_in_catch_up`): one per depth after the
    first; 0 for other heads. The one home of that rule."""
    return max(tree_depth - 1, 0) if getattr(head, "drafts_in_catch_up", False) else 0


def chain_depth(head: DraftModel | None, chain_length: int) -> int:
    """The draft tokens of a head's chain per round: `chain_length`, at most the B - 1 mask slots of a
    DFlash block (`drafts_block`: config.decode.block_chain_length)."""
    return (
        block_chain_length(chain_length, head.block_size)
        if getattr(head, "drafts_block", False)
        else chain_length
    )


def head_reads(head: DraftModel | None, device: torch.device) -> tuple[list[int] | None, torch.Tensor | None]:
    """(the target layers whose inputs the head reads, None: the last hidden state; its draft-to-target id
    map on `device`, None: it drafts over the target's vocabulary). The one home of that lookup."""
    vocab_map = getattr(head, "vocab_map", None)
    return getattr(head, "aux_layers", None), None if vocab_map is None else vocab_map.to(device)


def record_rounds(rounds: list[Round], stats: GenerationStats) -> None:
    """Per-round and per-node statistics of a generation's rounds, read to Python once per generation
    (not per round). Per draft node (roots excluded): depth, draft confidence given its parent, whether
    it was accepted, and whether its parent was (so the node was really tested: calibration)."""
    if not rounds:
        return
    depth = torch.cat([r.tree.depth[1:] for r in rounds]).tolist()
    parents = torch.cat([r.tree.parents[1:] for r in rounds]).tolist()
    first = 0
    for r in rounds:
        n = r.tree.size - 1
        on_path = set(r.path)  # the root (node 0) is always on it
        stats.accepted_per_round.append(len(r.path) - 1)
        stats.tree_depth_per_round.append(max(depth[first : first + n], default=0))
        stats.tree_size_per_round.append(n + 1)
        stats.node_accepted.extend(i in on_path for i in range(1, n + 1))
        stats.node_parent_accepted.extend(p in on_path for p in parents[first : first + n])
        first += n
    stats.rounds += len(rounds)
    stats.node_depth.extend(depth)
    if all(r.tree.confidence is not None for r in rounds):
        stats.node_confidence.extend(torch.cat([r.tree.confidence[1:] for r in rounds]).tolist())
