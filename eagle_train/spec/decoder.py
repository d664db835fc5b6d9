"""The speculative decoder: chain, EAGLE-1 static tree and EAGLE-2 dynamic tree, plus two baselines.

Public API (batch size 1):

    from eagle_train.config.decode import DecodeConfig
    from eagle_train.spec.decoder import SpeculativeDecoder

    decoder = SpeculativeDecoder(target, head, DecodeConfig(method="eagle2", depth=4, top_k=4, total_tokens=16))
    result = decoder.generate(prompt_ids)          # list[int] or LongTensor [seq] / [1, seq]
    result.tokens                                   # generated ids (stop token included), list[int]
    result.stop_reason                              # "stop_token" | "stop_string" | "max_new_tokens" | "context"
    result.stats.tau, result.stats.acceptance_by_position, result.stats.to_dict()

`target` is an `eagle_train.modeling.target.Target` (stock HF model + `decode` on a static KV cache);
`head` a `DraftHead` whose shared embedding / LM head are filled (None for methods `ar` and `hf`).
Methods: `ar` plain decoding in this harness (same cache code, one target forward per token), `hf`
Hugging Face `generate` (a second reference), `chain`, `eagle1` (static tree from conf/tree),
`eagle2` (dynamic tree). temperature 0 = greedy: the output equals `ar` token for token; temperature > 0:
lossless rejection sampling (`spec.verify`), the output is distributed as the target's.

Generation stops at a stop token (`Target.stop_token_ids`), a stop string, max_new_tokens, or when the
sequence reaches the context limit `Target.max_len` (prompt + generated <= max_len).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eagle_train.config.decode import DecodeConfig
from eagle_train.spec.drafter import Drafter
from eagle_train.spec.expand import expand_dynamic, expand_static, plan_static
from eagle_train.spec.stats import GenerationStats, Stopwatch
from eagle_train.spec.tree import Tree, shape_from_paths
from eagle_train.spec.verify import accept_greedy, accept_sampling, process_logits


@dataclass
class GenerationResult:
    """Generated token ids (the prompt excluded), why generation stopped, and its statistics."""

    tokens: list[int]
    stop_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)


class _Output:
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


class SpeculativeDecoder:
    """Decode with a target and a draft head according to a `DecodeConfig` (see the module docstring)."""

    def __init__(self, target, head, cfg: DecodeConfig):
        if cfg.speculative and head is None:
            raise ValueError(f"decode.method={cfg.method!r} needs a draft head")
        self.target, self.head, self.cfg = target, head, cfg
        self.device = target.device
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.plan = None
        if cfg.method in ("chain", "eagle1"):
            self.shape = shape_from_paths(cfg.static_paths())
            self.plan = plan_static(self.shape, self.device)
            self.tree_nodes, self.tree_inputs = self.shape.size, self.shape.size
        elif cfg.method == "eagle2":
            self.tree_nodes, self.tree_inputs = cfg.total_tokens, cfg.top_k * cfg.depth
        else:
            self.tree_nodes, self.tree_inputs = 1, 0
        self._plans: dict[int, object] = {}
        self._drafter: Drafter | None = None  # kept across generations (buffers, fused draft weights)
        self._sync = torch.cuda.synchronize if self.device.type == "cuda" else None

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
        out = _Output(self.cfg, prompt.numel(), max_len, self.target.stop_token_ids, self.target.tokenizer)
        start = time.perf_counter()
        with torch.inference_mode():  # cheaper tensor ops than no_grad; nothing here needs autograd
            if self.cfg.method == "hf":
                self._generate_hf(prompt, out)
            else:
                self._run(prompt, out, stats)
        stats.time_total = time.perf_counter() - start
        stats.new_tokens = len(out.tokens)
        return GenerationResult(tokens=out.tokens, stop_reason=out.reason or "max_new_tokens", stats=stats)

    # ---- target side ---------------------------------------------------------------------------------

    def _target_forward(self, tokens, positions, mask, stats: GenerationStats):
        t0 = time.perf_counter()
        logits, hidden = self.target.decode(tokens.unsqueeze(0), positions.unsqueeze(0), mask, self.cache)
        if self._sync is not None:
            self._sync()
        stats.time_target_forward += time.perf_counter() - t0
        return logits[0], hidden[0]  # [q, vocab], [q, hidden]

    def _choose(self, logits: torch.Tensor) -> int:
        """The target's next token from logits [vocab]: argmax, or a sample from the processed p."""
        if not self.sampling:
            return int(logits.argmax())
        probs = process_logits(logits, self.cfg.temperature, self.cfg.top_p, self.cfg.top_k_sampling)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _prefill(self, prompt: torch.Tensor, stats: GenerationStats):
        """Target forward over the prompt; returns (first generated token, features [n, hidden])."""
        n = prompt.numel()
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        logits, hidden = self._target_forward(
            prompt, torch.arange(n, device=self.device), causal[None, None], stats
        )
        self.cache.advance(n)
        return self._choose(logits[-1]), hidden

    def _run(self, prompt: torch.Tensor, out: _Output, stats: GenerationStats) -> None:
        # room for the prompt, the generated tokens and one tree; allocated once per generation
        self.capacity = prompt.numel() + out.limit + self.tree_nodes
        self.cache = self.target.new_cache(self.capacity)
        # mask rows for one verification forward; a round writes its tree mask into [:q, L:L + q] and restores it
        self.mask = torch.ones(self.tree_nodes, self.capacity, dtype=torch.bool, device=self.device)
        t0 = time.perf_counter()
        root, features = self._prefill(prompt, stats)
        if out.extend([root]):
            stats.time_prefill = time.perf_counter() - t0
            return
        if self.cfg.method == "ar":
            stats.time_prefill = time.perf_counter() - t0
            self._run_ar(root, out, stats)
            return
        drafter = self._new_drafter(stats)
        pending_tokens = torch.cat([prompt[1:], torch.tensor([root], device=self.device)])
        root_logp = drafter.catch_up(pending_tokens, features)
        stats.time_prefill = time.perf_counter() - t0
        watch = Stopwatch(stats, self._sync)
        # per round: node depths, node confidences, accepted path (statistics are gathered once, at the end;
        # not the trees: their draft distributions can be large)
        rounds: list[tuple[torch.Tensor, torch.Tensor | None, list[int]]] = []
        try:
            while True:
                with watch("time_draft"):
                    tree = self._draft(root, root_logp, drafter)
                if tree is None:  # no room left for a draft token: finish plainly
                    self._run_ar(root, out, stats)
                    return
                with watch("time_verify"):
                    path, emitted, hidden = self._verify(tree, stats)
                rounds.append((tree.depth, tree.confidence, path))
                if out.extend(emitted):
                    return
                root = emitted[-1]  # the bonus token
                with watch("time_draft"):
                    root_logp = drafter.catch_up(torch.tensor(emitted, device=self.device), hidden)
        finally:
            _record_rounds(rounds, stats)

    def _new_drafter(self, stats: GenerationStats) -> Drafter:
        """The decoder's drafter, reset for a generation with the current capacity (built on first use:
        the lean forward fuses the head's weights once, so later changes to the head are not seen)."""
        if self._drafter is None:
            self._drafter = Drafter(self.head, self.capacity, self.tree_inputs, stats, self.cfg.lean_draft)
        else:
            self._drafter.reset(self.capacity, stats)
        return self._drafter

    def _run_ar(self, token: int, out: _Output, stats: GenerationStats) -> None:
        """Plain decoding from `token` (not yet in the cache) with the same cache code."""
        while True:
            length = self.cache.seq_len
            ids = torch.tensor([token], device=self.device)
            logits, _ = self._target_forward(
                ids, ids.new_tensor([length]), self.mask[None, None, :1, : length + 1], stats
            )
            self.cache.advance(1)
            token = self._choose(logits[0])
            if out.extend([token]):
                return

    # ---- one speculative round ---------------------------------------------------------------------

    def _draft(self, root: int, root_logp: torch.Tensor, drafter: Drafter) -> Tree | None:
        """Draft this round's tree, no deeper than the context limit allows."""
        room = self.max_len - 1 - self.cache.seq_len  # deepest node position must be < max_len
        if room < 1:
            return None
        cfg = self.cfg
        if cfg.method == "eagle2":
            depth = min(cfg.depth, room - 1)  # the tree is depth + 1 deep
            return expand_dynamic(root, root_logp, drafter, depth, cfg.top_k, cfg.total_tokens)
        plan = self.plan if self.shape.max_depth <= room else self._truncated_plan(room)
        sample = self._draft_probs if self.sampling and cfg.sample_children else None
        return expand_static(plan, root, root_logp, drafter, sample, self.generator)

    def _draft_probs(self, log_probs: torch.Tensor) -> torch.Tensor:
        return process_logits(log_probs, self.cfg.temperature, self.cfg.top_p, self.cfg.top_k_sampling)

    def _truncated_plan(self, max_depth: int):
        if max_depth not in self._plans:
            self._plans[max_depth] = plan_static(self.shape.truncated(max_depth), self.device)
        return self._plans[max_depth]

    def _verify(self, tree: Tree, stats: GenerationStats) -> tuple[list[int], list[int], torch.Tensor]:
        """One target forward over the tree, acceptance, and cache compaction to the accepted path.
        Returns (path node ids, emitted tokens: the accepted draft tokens and the bonus token, target
        features of the path's nodes [len(path), hidden])."""
        n, length = tree.size, self.cache.seq_len
        region = self.mask[:n, length : length + n]
        region.copy_(tree.attention_mask)
        positions = tree.depth + length
        logits, hidden = self._target_forward(
            tree.tokens, positions, self.mask[None, None, :n, : length + n], stats
        )
        region.fill_(True)
        if self.sampling:
            probs = process_logits(logits, self.cfg.temperature, self.cfg.top_p, self.cfg.top_k_sampling)
            path, bonus = accept_sampling(tree, probs, self.generator)
        else:
            path, bonus = accept_greedy(tree, logits)
        tokens = tree.token_list
        emitted = [tokens[i] for i in path[1:]] + [bonus]
        if path[-1] == len(path) - 1:  # the path is the first nodes (e.g. a chain): already in place
            self.cache.advance(len(path))
            return path, emitted, hidden[: len(path)]
        keep = torch.tensor(path, device=self.device)
        self.cache.compact(length, keep)
        return path, emitted, hidden.index_select(0, keep)

    # ---- Hugging Face generate -----------------------------------------------------------------------

    def _generate_hf(self, prompt: torch.Tensor, out: _Output) -> None:
        cfg, model = self.cfg, self.target.model
        kwargs = dict(
            do_sample=self.sampling, max_new_tokens=out.limit, eos_token_id=self.target.stop_token_ids
        )
        if self.sampling:
            kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k_sampling or None)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        pad = self.target.tokenizer.pad_token_id
        ids = model.generate(
            prompt.unsqueeze(0),
            attention_mask=torch.ones_like(prompt).unsqueeze(0),
            pad_token_id=pad if pad is not None else self.target.stop_token_ids[0],
            **kwargs,
        )
        out.extend(ids[0, prompt.numel() :].tolist())


def _record_rounds(
    rounds: list[tuple[torch.Tensor, torch.Tensor | None, list[int]]], stats: GenerationStats
) -> None:
    """Per-round and per-node statistics of a generation's rounds (node depths [n], node confidences [n]
    or None, accepted path): the tensors are read once for the whole generation, not once per round."""
    if not rounds:
        return
    depth = torch.cat([d[1:] for d, _, _ in rounds]).tolist()  # the draft nodes (roots dropped)
    first = 0
    for d, _, path in rounds:
        n = d.shape[0] - 1
        accepted = set(path[1:])
        stats.accepted_per_round.append(len(path) - 1)
        stats.tree_depth_per_round.append(max(depth[first : first + n], default=0))
        stats.tree_size_per_round.append(n + 1)
        stats.node_accepted.extend(i in accepted for i in range(1, n + 1))
        first += n
    stats.rounds += len(rounds)
    stats.node_depth.extend(depth)
    if all(conf is not None for _, conf, _ in rounds):
        stats.node_confidence.extend(torch.cat([c[1:] for _, c, _ in rounds]).tolist())
