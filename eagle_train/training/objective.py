"""What one training step computes, per head type, behind one small interface the trainer calls.

An objective turns a collated micro-batch into named SUMS (loss terms with gradients, counts without)
and forms the loss from the sums and the GLOBAL normalisers of the optimizer step (all micro-batches,
all processes), so the loss does not depend on how a step is split. The pure formulas live in
`eagle_train.training.loss`; the unroll of EAGLE-3's training-time test in `eagle_train.training.ttt`.

    objective.prepare(batch, g)           derived no-grad fields (EAGLE-3: the target's greedy tokens;
                                          P-EAGLE: its COD elements, DFlash: its blocks, drawn from g;
                                          g None: a fixed seed)
    objective.normalisers(batch)          [c] this micro-batch's share of the step's normalisers
    objective.sums(model, batch, g)       {term: tensor} (g: the noise generator, None at evaluation)
    objective.loss(sums, normalisers)     the scalar to backpropagate
    objective.summary(totals)             the logged averages of summed terms (train windows, eval)
"""

from __future__ import annotations

from typing import Protocol

import torch

from eagle_train.config.train import LossConfig
from eagle_train.modeling.logit_transform import LogitTransform
from eagle_train.training.cod import CodBatch, by_depth, cod_attention_mask, cod_forward, flatten_cod
from eagle_train.training.dflash import (
    Blocks,
    accepted_prefix,
    block_attention_mask,
    block_labels,
    block_positions,
    sample_anchors,
    slot_ce,
    slot_weights,
)
from eagle_train.training.loss import (
    add_feature_noise,
    chain_parents,
    chunk_positions,
    combine_terms,
    combine_ttt_terms,
    eagle_loss_sums,
    parallel_loss_sums,
    shift_left,
    ttt_loss_sums,
    ttt_target_probs,
)
from eagle_train.training.ttt import unroll


class Objective(Protocol):
    terms: tuple[str, ...]  # the summed terms, in the order they are reduced across processes

    def prepare(
        self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]: ...

    def normalisers(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def sums(self, model, batch, generator: torch.Generator | None) -> dict[str, torch.Tensor]: ...

    def loss(self, sums: dict[str, torch.Tensor], normalisers: torch.Tensor) -> torch.Tensor: ...

    def summary(self, totals: dict[str, float]) -> dict[str, float]: ...


class EagleObjective:
    """EAGLE-1/2: feature_weight * SmoothL1 + token_weight * CE at the masked positions (noise on the
    input features when a generator is given)."""

    terms = ("smooth_l1", "ce", "correct", "tokens")

    def __init__(self, cfg: LossConfig, target_lm_head: torch.Tensor, transform: LogitTransform):
        self.cfg, self.lm_weight, self.transform = cfg, target_lm_head, transform

    def prepare(self, batch, generator=None):
        return batch

    def normalisers(self, batch):
        return batch["loss_mask"].sum().float().reshape(1)

    def sums(self, model, batch, generator):
        features = noisy_features(batch, self.cfg, generator)
        pred = model(batch["input_ids"], features)  # [b, n, d] f^_{j+1}
        return eagle_loss_sums(
            pred,
            batch["target_hidden"],
            self.lm_weight,
            batch["target_ids"],
            batch["loss_mask"],
            self.cfg.soft,
            transform=self.transform,
        )

    def loss(self, sums, normalisers):
        return combine_terms(sums, normalisers[0], self.cfg.feature_weight, self.cfg.token_weight)["loss"]

    def summary(self, totals):
        tokens = totals["tokens"]
        terms = combine_terms(  # float64 sums: the logged averages keep the precision of the reduced sums
            {k: torch.tensor(totals[k], dtype=torch.float64) for k in ("smooth_l1", "ce")},
            tokens,
            self.cfg.feature_weight,
            self.cfg.token_weight,
        )
        return {**{k: float(v) for k, v in terms.items()}, "top1": totals["correct"] / max(tokens, 1.0)}


class Eagle3Objective:
    """EAGLE-3: the head unrolled `ttt_steps` times over its own outputs; step k's soft CE against the
    target's distribution over the draft vocabulary at the assistant positions whose token is kept,
    weighted ttt_decay^k; accuracy per step against the target's greedy token."""

    def __init__(self, cfg: LossConfig, target_lm_head: torch.Tensor, transform: LogitTransform, head):
        self.cfg, self.lm_weight, self.transform, self.head = cfg, target_lm_head, transform, head
        self.steps = cfg.ttt_steps
        self.terms = tuple(
            f"{name}_{k}" for k in range(self.steps) for name in ("ce", "correct", "tokens", "positions")
        )

    @torch.no_grad()
    def prepare(self, batch, generator=None):
        """Adds `greedy` [b, n]: the target's greedy token argmax(lm_head(f_{j+1})) at the masked
        positions (it decides the soft loss's mask and every accuracy), and `labels` (soft: greedy;
        hard: the data token t_{j+2})."""
        mask = batch["loss_mask"].bool()
        greedy = torch.zeros_like(batch["target_ids"])
        logits = self.transform(batch["target_hidden"][mask].float() @ self.lm_weight.float().T)
        greedy[mask] = logits.max(-1).indices  # argmax's index (the first maximal one), faster on the CPU
        return {**batch, "greedy": greedy, "labels": greedy if self.cfg.soft else batch["target_ids"]}

    @property
    def t2d(self) -> torch.Tensor:
        """[vocab] bool, read from the head each time (a resumed run restores its vocabulary)."""
        return self.head.t2d.to(self.lm_weight.device)

    def _trainable(self, batch, k: int) -> torch.Tensor:
        return shift_left(batch["loss_mask"].bool() & self.t2d[batch["labels"]], k, False)

    def normalisers(self, batch):
        return torch.stack([self._trainable(batch, k).sum().float() for k in range(self.steps)])

    def sums(self, model, batch, generator):
        features = noisy_features(batch, self.cfg, generator)
        head = getattr(model, "module", model)  # the logits of a DDP/DeepSpeed-wrapped head
        draft_ids, t2d, sums = head.vocab_map.to(self.lm_weight.device), self.t2d, {}
        probs = (  # the soft targets of step 0, shifted for the later steps
            ttt_target_probs(
                batch["target_hidden"],
                self.lm_weight[draft_ids],
                self._trainable(batch, 0),
                None if self.transform.identity else self.transform,
            )
            if self.cfg.soft
            else None
        )
        for k, state in enumerate(unroll(model, batch["input_ids"], features, self.steps)):
            step = ttt_loss_sums(
                state,
                head.logits,
                shift_left(probs, k, 0.0) if probs is not None else None,
                draft_ids,
                t2d,
                shift_left(batch["labels"], k, 0),
                shift_left(batch["greedy"], k, -1),
                shift_left(batch["loss_mask"], k, False),
                self.cfg.soft,
            )
            sums.update({f"{name}_{k}": value for name, value in step.items()})
        return sums

    def loss(self, sums, normalisers):
        ce = [sums[f"ce_{k}"] for k in range(self.steps)]
        return combine_ttt_terms(ce, list(normalisers), self.cfg.ttt_decay)["loss"]

    def summary(self, totals):
        steps = range(self.steps)
        terms = combine_ttt_terms(
            [torch.tensor(totals[f"ce_{k}"], dtype=torch.float64) for k in steps],
            [totals[f"tokens_{k}"] for k in steps],
            self.cfg.ttt_decay,
        )
        out = {k: float(v) for k, v in terms.items()}
        out["ce"] = out["ce_step1"]
        for k in steps:
            out[f"ttt_acc_step{k + 1}"] = totals[f"correct_{k}"] / max(totals[f"positions_{k}"], 1.0)
        out["top1"] = out["ttt_acc_step1"]
        out["vocab_coverage"] = totals["tokens_0"] / max(totals["positions_0"], 1.0)
        return out


class PEagleObjective(Eagle3Objective):
    """P-EAGLE: the micro-batch's COD elements (eagle_train.training.cod: real pairs at depth 0, placeholders
    after) through the head in ONE forward; the soft CE (or KL) of every element on the loss mask whose
    token is in the draft vocabulary, all depths pooled with no decay; accuracy per depth against the
    target's greedy token. The COD sample is drawn in `prepare` from the micro-batch's generator."""

    def __init__(self, cfg: LossConfig, target_lm_head: torch.Tensor, transform: LogitTransform, head):
        super().__init__(cfg, target_lm_head, transform, head)
        self.steps = cfg.cod.num_depths
        self.terms = tuple(
            f"{name}_{d}" for d in range(self.steps) for name in ("ce", "correct", "tokens", "positions")
        )

    @torch.no_grad()
    def prepare(self, batch, generator=None):
        """EAGLE-3's fields plus the COD elements (`cod_anchor`, `cod_depth`, `cod_real` [b, T]); without
        a generator (evaluation) a fixed seed."""
        batch = super().prepare(batch)
        device, cod = batch["loss_mask"].device, self.cfg.cod
        generator = generator or torch.Generator(device=device).manual_seed(0)
        elements = flatten_cod(
            batch["loss_mask"],
            batch["positions"],
            cod.num_depths,
            cod.r,
            cod.r_min,
            generator,
            cod.max_anchors,
        )
        return {
            **batch,
            "cod_anchor": elements.anchor,
            "cod_depth": elements.depth,
            "cod_real": elements.real,
        }

    @staticmethod
    def elements(batch) -> CodBatch:
        return CodBatch(batch["cod_anchor"], batch["cod_depth"], batch["cod_real"])

    def _on_mask(self, batch, cod: CodBatch) -> torch.Tensor:
        """[b, T] bool: the real elements whose position is on the loss mask."""
        return cod.real & cod.gather(batch["loss_mask"].bool())

    def normalisers(self, batch):
        cod = self.elements(batch)
        trainable = self._on_mask(batch, cod) & cod.gather(self.t2d[batch["labels"]])
        return trainable.sum().float().reshape(1)

    def sums(self, model, batch, generator):
        head, cod = getattr(model, "module", model), self.elements(batch)
        features = noisy_features(batch, self.cfg, generator)
        rows, positions, depth, states = self._elements_on_mask(model, head, batch, features, cod)
        picked = lambda x: x[rows, positions]  # noqa: E731 [M, ...]: at each element's head position
        draft_ids, labels = head.vocab_map.to(self.lm_weight.device), picked(batch["labels"])
        draft_index = torch.cumsum(self.t2d.long(), 0) - 1  # [vocab] the draft id of each kept token
        sums = parallel_loss_sums(
            states, head.logits, picked(batch["target_hidden"]), self.lm_weight[draft_ids],
            draft_index[labels], picked(batch["greedy"]), self.t2d[labels], depth, draft_ids,
            self.steps, self.cfg.soft, self.cfg.divergence == "kl",
            None if self.transform.identity else self.transform,
            parents=chain_parents(rows, positions, depth, batch["loss_mask"].shape, self.steps)
            if self.cfg.cod.weighting == "accepted" and generator is not None else None,  # held out: all
        )  # fmt: skip
        return {f"{name}_{d}": sums[name][d] for d in range(self.steps) for name in sums}

    def _elements_on_mask(self, model, head, batch, features, cod: CodBatch):
        """(row [M], head position [M], depth [M], state [M, d]) of every element on the loss mask, from
        one forward over the flattened sequence (an accelerator: the memory-efficient attention kernel
        takes its mask) or depth by depth (a CPU: `cod_forward`, the same states, several times faster)."""
        mask = batch["loss_mask"].bool()
        rows = torch.arange(mask.shape[0], device=mask.device)[:, None]
        if mask.device.type != "cpu":
            ids, feats = head.placeholders(
                cod.gather(batch["input_ids"]), cod.gather(features), cod.depth > 0
            )
            states = model(ids, feats, cod.positions, cod_attention_mask(cod), None)  # [b, T, d]
            on = self._on_mask(batch, cod)
            return rows.expand_as(on)[on], cod.positions[on], cod.depth[on], states[on]
        depths = by_depth(cod, self.steps)
        per_depth = cod_forward(head, batch["input_ids"], features, depths, forward=model)
        n = mask.shape[1]
        found = [(rows.expand_as(mask)[mask], torch.nonzero(mask)[:, 1], torch.zeros_like(mask[mask], dtype=torch.long),
                  per_depth[0][mask])]  # fmt: skip
        for d, (anchor, valid, states) in enumerate(
            zip(depths.anchors, depths.valid, per_depth[1:], strict=True), start=1
        ):
            on = valid & mask.gather(1, (anchor + d).clamp(max=n - 1))
            found.append(
                (rows.expand_as(on)[on], (anchor + d)[on], torch.full_like(anchor[on], d), states[on])
            )
        return tuple(torch.cat(parts) for parts in zip(*found, strict=True))

    def loss(self, sums, normalisers):
        ce = sum(sums[f"ce_{d}"] for d in range(self.steps))
        return combine_ttt_terms([ce], [normalisers[0]], 1.0)["loss"]

    def summary(self, totals):
        depths = range(self.steps)
        pooled = combine_ttt_terms(
            [torch.tensor(sum(totals[f"ce_{d}"] for d in depths), dtype=torch.float64)],
            [sum(totals[f"tokens_{d}"] for d in depths)],
            1.0,
        )
        out = {"loss": float(pooled["loss"]), "ce": float(pooled["loss"])}
        for d in depths:
            out[f"ce_depth{d + 1}"] = totals[f"ce_{d}"] / max(totals[f"tokens_{d}"], 1.0)
            out[f"cod_acc_depth{d + 1}"] = totals[f"correct_{d}"] / max(totals[f"positions_{d}"], 1.0)
            out[f"cod_elements_depth{d + 1}"] = totals[f"positions_{d}"]
        out["top1"] = out["cod_acc_depth1"]
        out["vocab_coverage"] = totals["tokens_0"] / max(totals["positions_0"], 1.0)
        return out


class DFlashObjective:
    """DFlash: up to loss.num_anchors blocks per sequence (drawn in `prepare` from the micro-batch's
    generator, anew every step), all of them in ONE draft forward under the block attention mask
    (eagle_train.training.dflash); the CE of slot k >= 1 against the data token t_{a+k} where it is
    supervised, weighted exp(-(k - 1) / gamma) and averaged over the step's weights; per-slot accuracy and
    the simulated acceptance (1 + the leading slots drafted right, per block)."""

    def __init__(self, cfg: LossConfig, target_lm_head: torch.Tensor, transform: LogitTransform, head):
        self.cfg, self.lm_weight, self.block = cfg, target_lm_head, head.block_size
        self.weights = slot_weights(self.block, cfg.dflash_gamma)  # [B]
        slots = range(1, self.block)
        per_slot = tuple(f"{name}_{k}" for k in slots for name in ("ce", "correct", "tokens"))
        self.terms = ("ce_weighted", *per_slot, "accepted", "blocks")

    @torch.no_grad()
    def prepare(self, batch, generator=None):
        """Adds the blocks (`dflash_anchor`, `dflash_valid` [b, A]); without a generator (evaluation) a
        fixed seed."""
        generator = generator or torch.Generator(device=batch["loss_mask"].device).manual_seed(0)
        blocks = sample_anchors(
            batch["loss_mask"], batch["positions"], self.block, self.cfg.num_anchors, generator
        )
        return {**batch, "dflash_anchor": blocks.anchor, "dflash_valid": blocks.valid}

    def _labels(self, batch):
        blocks = Blocks(batch["dflash_anchor"], batch["dflash_valid"])
        return (blocks, *block_labels(batch["input_ids"], batch["loss_mask"], blocks, self.block))

    def normalisers(self, batch):
        _, _, supervised = self._labels(batch)
        return (supervised.float() * self.weights.to(supervised.device)).sum().reshape(1)

    def sums(self, model, batch, generator):
        head = getattr(model, "module", model)
        blocks, tokens, supervised = self._labels(batch)  # [b, A, B] each
        ids = tokens.clone()
        ids[..., 1:] = head.mask_token_id  # [t_a, MASK x (B-1)]
        mask = block_attention_mask(blocks, batch["input_ids"].shape[1], self.block)
        features = noisy_features(batch, self.cfg, generator)
        states = model(ids.flatten(1), features, block_positions(blocks, self.block), None, mask)
        chosen = supervised.flatten(1)  # [b, A * B]
        chunk = chunk_positions(self.lm_weight.shape[0], states.device)
        ce, hit = slot_ce(states[chosen], head.logits, tokens.flatten(1)[chosen], chunk)
        slot = torch.arange(self.block, device=ce.device).expand_as(tokens)[supervised]  # [M]
        correct = torch.zeros_like(supervised)
        correct[supervised] = hit
        zeros = torch.zeros(self.block, device=ce.device)
        per_slot = {
            "ce": zeros.index_add(0, slot, ce.detach()),
            "correct": zeros.index_add(0, slot, hit.float()),
            "tokens": zeros.index_add(0, slot, torch.ones_like(ce)),
        }
        accepted = accepted_prefix(correct, supervised)[blocks.valid]
        return {
            "ce_weighted": (self.weights.to(ce.device)[slot] * ce).sum(),
            **{f"{name}_{k}": v[k] for name, v in per_slot.items() for k in range(1, self.block)},
            "accepted": accepted.sum().float(),
            "blocks": blocks.valid.sum().float(),
        }

    def loss(self, sums, normalisers):
        return sums["ce_weighted"] / torch.clamp(normalisers[0], min=1e-12)

    def summary(self, totals):
        weight = sum(float(self.weights[k]) * totals[f"tokens_{k}"] for k in range(1, self.block))
        tokens = sum(totals[f"tokens_{k}"] for k in range(1, self.block))
        out = {
            "loss": totals["ce_weighted"] / max(weight, 1e-12),
            "ce": sum(totals[f"ce_{k}"] for k in range(1, self.block)) / max(tokens, 1.0),
            "accept_len": totals["accepted"] / max(totals["blocks"], 1.0),
            "blocks": totals["blocks"],
        }
        for k in range(1, self.block):
            out[f"ce_slot{k}"] = totals[f"ce_{k}"] / max(totals[f"tokens_{k}"], 1.0)
            out[f"acc_slot{k}"] = totals[f"correct_{k}"] / max(totals[f"tokens_{k}"], 1.0)
        out["top1"] = out["acc_slot1"]
        return out


def noisy_features(batch, cfg: LossConfig, generator: torch.Generator | None) -> torch.Tensor:
    """The micro-batch's input features, with the configured noise when a generator is given (each
    sequence's tokens = its head positions + 1)."""
    if generator is None:
        return batch["features"]
    return add_feature_noise(batch["features"], cfg.noise, cfg.noise_scale, generator, batch["positions"] + 1)
