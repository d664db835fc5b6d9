"""The draft head at decode time: its KV cache, the per-round catch-up pass and the tree draft step.

The head's input at position j is the pair (f_j, t_{j+1}); its output f^_{j+1} gives the draft
distribution of t_{j+2} (EAGLE-3: f_j is the target's aux features a_j, the output the draft's state,
and the distribution is over its draft vocabulary; the decoder maps draft ids to target ids). Committed cache slots hold pairs built from the TARGET's features of accepted
tokens. Each round starts with `catch_up`: the pairs of last round's accepted tokens + bonus token,
whose features the verification forward already produced (no extra target forward). Its last output is
the root's draft state. Tree inputs then go after the committed slots (`__call__`, the `DraftStep` of
`decoding.expand`) and are dropped at the next catch-up. A decoder keeps one `Drafter` for all its generations
(`reset`): buffers grow when needed, the fused weights of the lean forward are built once.

A P-EAGLE head (`parallel` > 0) drafts in the catch-up itself, as vLLM does: the same forward carries
`parallel` placeholders (its mask token and mask_hidden) after the real pairs, causal, at the next
positions; the placeholder at slot k gives the draft distribution of the tokens at depth k + 1 below the
root, whatever their parents (it never sees the drafted tokens). The draft step then runs no forward: it
hands each input at depth k that row, so the chain, the static trees and the dynamic trees of
`decoding.expand` are all drafted from that one forward (the placeholders' cache entries are written over
at the next catch-up).

A DFlash head (`drafts_block`) runs through `BlockDrafter`: its cache holds the context (every layer's keys
and values of the target's features at the committed positions), appended at each catch-up and never
recomputed, and the catch-up drafts the round's block [root, MASK x (B-1)] in one forward; slot k's
distribution is handed to the draft step for depth k, as P-EAGLE's placeholder rows are.
"""

from __future__ import annotations

import torch

from eagle_train.decoding import lean_draft
from eagle_train.decoding.kv_cache import StaticKVCache, attention_shape
from eagle_train.decoding.stats import GenerationStats
from eagle_train.decoding.timing import PhaseTimer


class Drafter:
    """Runs a draft head (see `eagle_train.modeling.draft.DraftHead`) with a preallocated cache. Its calls
    run under the caller's `torch.inference_mode()` (the decoder's): no autograd context of their own."""

    def __init__(
        self,
        head,
        capacity: int,
        max_tree_inputs: int,
        stats: GenerationStats,
        lean: bool = True,
        *,
        timer: PhaseTimer | None = None,
        parallel: int = 0,
    ):
        config = head.config
        param = next(head.parameters())
        # P-EAGLE: placeholders per catch-up (the deepest tree depth - 1); the cache keeps room for them
        self.parallel = parallel
        self.head, self.max_tree_inputs = head, max(max_tree_inputs, parallel)
        self.device, self.dtype = param.device, param.dtype
        shape = attention_shape(config)
        self.head_dim, self.kv_heads = shape.head_dim, shape.kv_heads
        # Row i: the output of tree input i (the root's draft state is `self.root`, set by `catch_up`).
        self.hidden = torch.zeros(
            max(1, max_tree_inputs), int(config.hidden_size), dtype=self.dtype, device=self.device
        )
        self.root = self.hidden[:1]
        # P-EAGLE: [parallel + 1, vocab], row k the distribution of the nodes at depth k + 1 below the root
        # (row 0: the root's children, from the real pair; the rest from the placeholders)
        self.round_logp: torch.Tensor | None = None
        if parallel:
            mask_hidden = head.mask_hidden.detach().reshape(1, -1).to(self.dtype)  # [1, 3 d_t]
            self.placeholder_features = mask_hidden.expand(parallel, -1)
            self.placeholder_tokens = torch.full((parallel,), head.mask_token_id, device=self.device)
        # The head's forward as fused tensor ops (same numbers, a fraction of the per-call overhead).
        self.lean = lean_draft.lean_forward(head) if lean else None
        self.capacity = -1
        self.reset(capacity, stats, timer)

    def reset(self, capacity: int, stats: GenerationStats, timer: PhaseTimer | None = None) -> None:
        """Start a new generation of at most `capacity` committed pairs; its draft forwards are timed into
        `stats` by `timer` (the decoder's; None: the host clock). The cache, mask and position buffers (and
        the lean forward's fused weights) are kept when they are big enough."""
        self.stats = stats
        self.timer = timer if timer is not None else PhaseTimer(stats)
        self.committed = 0  # pairs in the cache = position of the root token
        self.fed = 0  # tree inputs fed this round
        if capacity <= self.capacity:
            self.cache.crop(0)
            self.mask.fill_(True)  # a generation may end with a tree region written
            return
        self.capacity = capacity
        total = capacity + self.max_tree_inputs
        layers = int(self.head.config.num_hidden_layers)
        self.cache = StaticKVCache(
            layers, self.kv_heads, self.head_dim, total, dtype=self.dtype, device=self.device
        )
        self.mask = torch.ones(max(1, self.max_tree_inputs), total, dtype=torch.bool, device=self.device)
        self.mask4 = self.mask[None, None]  # [1, 1, rows, total]: the view the forward takes slices of
        self.positions = torch.arange(total + 1, device=self.device)
        if self.lean is not None:
            self.lean.extend_positions(total + 1)

    def _forward(self, tokens, features, positions: slice, mask, last: int | None = None):
        """positions: a slice of positions, one per input or one for all inputs. Returns the predicted
        features [m, hidden] and the draft log-probs [m, vocab] (of the `last` inputs only: [last, vocab])."""
        start = self.timer.start()
        if self.lean is not None:
            hidden = self.lean.forward(tokens, features, positions, mask, self.cache)
            logp = self.lean.log_probs(hidden[-last:] if last else hidden)
        else:
            pos = self.positions[positions].expand(tokens.shape[0]).unsqueeze(0)
            hidden = self.head(tokens.unsqueeze(0), features.unsqueeze(0), pos, mask, self.cache)[0]
            logp = torch.log_softmax(self.head.logits(hidden[-last:] if last else hidden).float(), dim=-1)
        self.timer.stop("time_draft_forward", start)
        return hidden, logp

    def catch_up(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Commit pairs (features[i], tokens[i]) at the next positions; tokens [m], features [m, hidden]
        (the target's). Returns the draft log-probs [vocab] of the root's children (root = tokens[-1]).
        P-EAGLE: the placeholders ride along (module docstring); their rows are kept for the draft steps."""
        self.drop_tree()
        m, extra = tokens.shape[0], self.parallel
        if extra:
            tokens = torch.cat([tokens, self.placeholder_tokens[:extra]])
            features = torch.cat([features.to(self.dtype), self.placeholder_features[:extra]])
        positions = slice(self.committed, self.committed + m + extra)
        hidden, logp = self._forward(
            tokens, features.to(self.dtype), positions, None, last=extra + 1
        )  # None = causal
        self.cache.advance(m)
        self.committed += m
        self.root = hidden[
            m - 1 : m
        ]  # [1, hidden]: the root's draft state, the parent of every depth-1 input
        self.round_logp = logp if extra else None
        return logp[0]

    def rewind(self, committed: int) -> None:
        """Forget the committed pairs after the first `committed` (and any tree): a cost measurement
        times one catch-up again and again at the same position (autotune.costs)."""
        self.drop_tree()
        self.committed = committed
        self.cache.crop(committed)

    def drop_tree(self) -> None:
        """Forget the tree inputs fed since the last catch-up (the root's draft state is kept), so another
        tree can be drafted below the same root."""
        self.cache.crop(self.committed)
        if self.fed:  # the tree region becomes committed columns again: attend to them
            self.mask[:, self.committed :].fill_(True)
        self.fed = 0

    def __call__(
        self, tokens: torch.Tensor, parents: torch.Tensor, tree_mask: torch.Tensor, depth: int
    ) -> torch.Tensor:
        """The tree draft step (see `decoding.expand`): inputs at `depth` below the root. P-EAGLE: the
        catch-up's placeholder row for depth + 1, one per input (no forward)."""
        if self.round_logp is not None:
            return depth_rows(
                self.round_logp, depth, tokens.shape[0], f"{self.parallel} P-EAGLE placeholders"
            )
        m, base = tokens.shape[0], self.committed
        # [m, hidden]: each parent's draft state (depth 1: all children of the root, parents -1)
        features = self.root.expand(m, -1) if depth == 1 else self.hidden[parents]
        position = base - 1 + depth  # the pair (parent's draft state, token at position base + depth)
        positions = slice(position, position + 1)  # the same for all m inputs
        kv_end = base + self.fed + m
        self.mask[:m, base:kv_end] = tree_mask  # the tree region (restored at the next catch-up)
        hidden, logp = self._forward(tokens, features, positions, self.mask4[:, :, :m, :kv_end])
        self.cache.advance(m)
        self.hidden[self.fed : self.fed + m] = hidden
        self.fed += m
        return logp


def depth_rows(round_logp: torch.Tensor, depth: int, m: int, source: str) -> torch.Tensor:
    """The draft step of a head that drafted the whole round in one forward: row `depth` of `round_logp`
    [depths, vocab] (the distribution of the nodes at depth + 1 below the root) for each of `m` inputs."""
    if depth >= round_logp.shape[0]:
        raise ValueError(f"a tree {depth + 1} deep from {source}")
    return round_logp[depth].expand(m, -1)


class BlockDrafter:
    """Runs a DFlash head (`modeling.dflash.DFlashHead`) at decode time with a preallocated cache of its
    context: the same calls as `Drafter` (`reset`, `catch_up`, the draft step, `rewind`) under the caller's
    `torch.inference_mode()`. The block sits at the root's position onwards and attends to the whole context
    and the whole block, as the head trained; slot k >= 1 gives the distribution of the token at depth k."""

    def __init__(self, head, capacity: int, stats: GenerationStats, timer: PhaseTimer | None = None):
        param = next(head.parameters())
        self.head, self.device, self.dtype = head, param.device, param.dtype
        self.block_size = int(head.block_size)
        # [1, B]: the root (written per round), then the mask token in every other slot
        self.block = torch.full((1, self.block_size), int(head.mask_token_id), device=self.device)
        self.round_logp: torch.Tensor | None = None  # [B - 1, vocab]: slot k's distribution in row k - 1
        self.capacity = -1
        self.reset(capacity, stats, timer)

    def reset(self, capacity: int, stats: GenerationStats, timer: PhaseTimer | None = None) -> None:
        """Start a new generation of at most `capacity` committed positions (buffers kept when big enough)."""
        self.stats = stats
        self.timer = timer if timer is not None else PhaseTimer(stats)
        self.committed = 0  # context positions in the cache = the position of the root token
        self.round_logp = None
        if capacity <= self.capacity:
            self.cache.crop(0)
            return
        self.capacity = capacity
        shape, total = attention_shape(self.head.config), capacity + self.block_size
        layers = int(self.head.config.num_hidden_layers)
        self.cache = StaticKVCache(
            layers, shape.kv_heads, shape.head_dim, total, dtype=self.dtype, device=self.device
        )
        self.positions = torch.arange(total, device=self.device)

    def catch_up(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Commit the context of the next positions (features [m, L d_t]: the target's, as `Drafter.catch_up`
        takes them) and draft the block of the root tokens[-1], at the position after them. Returns the
        draft log-probs [vocab] of the root's children; `round_logp` holds every slot's."""
        m, start = tokens.shape[0], self.timer.start()
        self.cache.crop(self.committed)  # last round's block entries are dropped
        at = self.positions[self.committed : self.committed + m + self.block_size].unsqueeze(0)
        self.head.write_context(features.to(self.dtype).unsqueeze(0), at[:, :m], self.cache)
        self.committed += m
        self.block[0, 0] = tokens[-1]
        hidden = self.head.draft_block(self.block, at[:, m:], self.cache)[0, 1:]  # [B - 1, d]: slots 1..B-1
        self.round_logp = torch.log_softmax(self.head.logits(hidden).float(), dim=-1)
        self.timer.stop("time_draft_forward", start)
        return self.round_logp[0]

    def rewind(self, committed: int) -> None:
        """Forget the context after its first `committed` positions."""
        self.committed = committed
        self.cache.crop(committed)

    def __call__(
        self, tokens: torch.Tensor, parents: torch.Tensor, tree_mask: torch.Tensor, depth: int
    ) -> torch.Tensor:
        """The draft step (see `decoding.expand`): slot depth + 1's distribution for every input at `depth`
        (no forward: the block's slots never see the tokens drafted before them)."""
        return depth_rows(self.round_logp, depth, tokens.shape[0], f"a DFlash block of {self.block_size}")
