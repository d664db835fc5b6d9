"""Fixtures for the decoder tests: a scripted draft (log-probs as a function of the token path) and
draft heads for stories260K (random, and one trained here for a few hundred steps on real features)."""

from __future__ import annotations

import functools
import hashlib

import pytest
import torch

from tests.conftest import DATA, untrained_dflash_head


@functools.lru_cache(maxsize=100_000)
def path_log_probs(path: tuple[int, ...], vocab: int, scale: float = 2.0) -> torch.Tensor:
    """Deterministic, tie-free log-probs [vocab] for a token path (seeded by a hash of the path)."""
    seed = int.from_bytes(hashlib.sha256(repr(path).encode()).digest()[:6], "little")
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * scale, -1).float()


class ScriptedDraft:
    """A `DraftStep` whose output depends only on the token path from the root; it checks that every
    call's parents, tree mask and depth describe that path exactly."""

    def __init__(self, root: int, vocab: int, scale: float = 2.0):
        self.root, self.vocab, self.scale = root, vocab, scale
        self.paths: list[tuple[int, ...]] = []  # token path (root first) of every fed input
        self.ancestors: list[set[int]] = []  # fed indices of every fed input's fed ancestors
        self.calls = 0

    def reset(self) -> None:
        self.paths.clear()
        self.ancestors.clear()

    def root_log_probs(self) -> torch.Tensor:
        return path_log_probs((self.root,), self.vocab, self.scale)

    def __call__(self, tokens, parents, tree_mask, depth):
        self.calls += 1
        m = tokens.shape[0]
        assert tree_mask.shape == (m, len(self.paths) + m)
        new_paths, new_ancestors = [], []
        for i in range(m):
            parent = int(parents[i])
            base = (self.root,) if parent == -1 else self.paths[parent]
            path = (*base, int(tokens[i]))
            assert len(path) - 1 == depth, "depth must match the path"
            ancestors = set() if parent == -1 else {*self.ancestors[parent], parent}
            expected = {*ancestors, len(self.paths) + i}
            assert set(torch.nonzero(tree_mask[i]).flatten().tolist()) == expected, (
                "tree mask != ancestors + self"
            )
            new_paths.append(path)
            new_ancestors.append(ancestors)
        self.paths.extend(new_paths)
        self.ancestors.extend(new_ancestors)
        return torch.stack([path_log_probs(p, self.vocab, self.scale) for p in new_paths])


@pytest.fixture
def scripted_draft():
    return ScriptedDraft


@pytest.fixture(scope="session")
def random_head(target):
    """An untrained head (fixed seed) sharing the target's embedding and LM head."""
    from eagle_train.modeling.draft import DraftHead

    torch.manual_seed(1)
    head = DraftHead.from_target(target.config)
    head.share_target_weights(target)
    return head.eval()


def train_head(target, steps: int = 250, seq_len: int = 128, batch: int = 8, lr: float = 3e-3, seed: int = 0):
    """A small head trained on the target's own features of TinyStories text (SmoothL1 + soft CE)."""
    torch.manual_seed(seed)
    return _train(target, steps, seq_len, batch, lr)


def _train(target, steps, seq_len, batch, lr):
    from eagle_train.modeling.draft import DraftHead

    rows = _tinystories_rows(target, seq_len)
    logits, feats = target.features(rows)  # [rows, seq, vocab], [rows, seq, hidden]
    head = DraftHead.from_target(target.config)
    head.share_target_weights(target)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95))
    for _ in range(steps):
        pick = torch.randint(0, rows.shape[0], (batch,))
        f, t, lg = feats[pick], rows[pick], logits[pick]
        pred = head(t[:, 1:], f[:, :-1])  # pairs (f_j, t_{j+1}) -> f^_{j+1}
        reg = torch.nn.functional.smooth_l1_loss(pred[:, :-1], f[:, 1:-1])
        target_p = torch.softmax(lg[:, 1:-1], -1)
        ce = -(target_p * torch.log_softmax(head.logits(pred[:, :-1]), -1)).sum(-1).mean()
        loss = reg + 0.1 * ce
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="session")
def trained_head(target):
    return train_head(target)


@pytest.fixture(scope="session")
def random_eagle3_head(target):
    """An untrained EAGLE-3 head (fixed seed) over a 256-token draft vocabulary (the most frequent ids
    of the TinyStories text), reading the target's layers 1, 2, 4."""
    from eagle_train.modeling.eagle3 import Eagle3Head

    torch.manual_seed(2)
    head = Eagle3Head.from_target(target.config, target.aux_layers, 256)
    head.set_vocabulary(_tinystories_vocabulary(target, 256), target.lm_head.weight)
    head.share_target_weights(target)
    return head.eval()


def _tinystories_rows(target, seq_len: int = 128) -> torch.Tensor:
    text = (DATA / "tinystories" / "tinystories_val_head.txt").read_text()
    ids = torch.tensor(target.tokenizer(text[:60_000])["input_ids"])
    n = (ids.numel() // seq_len) * seq_len
    return ids[:n].view(-1, seq_len)


def _tinystories_vocabulary(target, size: int) -> torch.Tensor:
    from eagle_train.modeling.draft_vocab import count_assistant_tokens, top_tokens

    rows = _tinystories_rows(target)
    counts = count_assistant_tokens(
        ((r, torch.ones_like(r, dtype=torch.bool)) for r in rows), target.vocab_size
    )
    return top_tokens(counts, size)


def train_eagle3_head(
    target,
    steps: int = 200,
    batch: int = 8,
    lr: float = 3e-3,
    vocab: int = 256,
    seed: int = 0,
    kind: str = "eagle3",
    layers: int = 1,
):
    """A small EAGLE-3 head trained with the package's own objective (training-time test of 3 steps,
    soft CE over a 256-token draft vocabulary) on the target's features of TinyStories text; kind
    "peagle": a P-EAGLE head (its mask token <unk>, COD over 4 depths)."""
    from eagle_train.config.train import CodConfig, LossConfig
    from eagle_train.modeling.eagle3 import Eagle3Head
    from eagle_train.modeling.peagle import PEagleHead

    torch.manual_seed(seed)
    rows = _tinystories_rows(target)
    hidden, aux = target.aux_hidden_states(rows, None, target.aux_layers)
    if kind == "peagle":
        head = PEagleHead.from_target(target.config, target.aux_layers, vocab, 0, num_layers=layers)
    else:
        head = Eagle3Head.from_target(target.config, target.aux_layers, vocab, num_layers=layers)
    head.set_vocabulary(_tinystories_vocabulary(target, vocab), target.lm_head.weight)
    head.share_target_weights(target)
    loss = LossConfig(ttt_steps=3, noise="none", cod=CodConfig(num_depths=4))
    return train_with_objective(target, head, kind, loss, rows, hidden, aux, steps, batch, lr, seed)


def train_with_objective(target, head, kind: str, loss, rows, hidden, aux, steps, batch, lr, seed):
    """`steps` AdamW steps of `head` with its kind's own objective (`loss`: a LossConfig) on `batch` rows
    [rows, seq] of the target's features (`hidden`, `aux`) a step, every position supervised."""
    from eagle_train.heads import head_kind
    from eagle_train.training.data import collate

    objective = head_kind(kind).objective(loss, target.lm_head.weight, target.logit_transform, head)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95))
    mask = torch.ones(rows.shape[1], dtype=torch.bool)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        pick = torch.randint(0, rows.shape[0], (batch,)).tolist()
        samples = [
            {"input_ids": rows[i], "loss_mask": mask, "hidden": hidden[i], "aux": aux[i]} for i in pick
        ]
        b = objective.prepare(collate(samples), g)
        value = objective.loss(objective.sums(head, b, None), objective.normalisers(b))
        opt.zero_grad()
        value.backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="session")
def trained_eagle3_head(target):
    return train_eagle3_head(target)


@pytest.fixture(scope="session")
def trained_peagle_head(target):
    """A 2-layer P-EAGLE head trained with its own objective (COD over 4 depths, one forward per step)."""
    return train_eagle3_head(target, kind="peagle", layers=2)


@pytest.fixture(scope="session")
def random_peagle_head(target):
    """An untrained P-EAGLE head (fixed seed): mask_hidden and its mask row random."""
    from eagle_train.modeling.peagle import PEagleHead

    torch.manual_seed(3)
    head = PEagleHead.from_target(target.config, target.aux_layers, 256, 0, num_layers=2)
    head.set_vocabulary(_tinystories_vocabulary(target, 256), target.lm_head.weight)
    head.share_target_weights(target)
    return head.eval()


def train_dflash_head(
    target, steps: int = 600, block: int = 4, layers: int = 1, lr: float = 3e-3, seed: int = 0
):
    """A small DFlash head trained with the package's own objective (blocks of `block` in one forward,
    32 anchors per sequence) on the outputs of target layers 0, 1, 3 over TinyStories text (about 20 s)."""
    from eagle_train.config.train import LossConfig
    from eagle_train.modeling.dflash import DFlashHead

    torch.manual_seed(seed)
    rows = _tinystories_rows(target)
    head = DFlashHead.from_target(target.config, [0, 1, 3], block, 0, target=target, num_layers=layers)
    hidden, aux = target.aux_hidden_states(rows, None, head.aux_layers)
    loss = LossConfig(num_anchors=32)
    return train_with_objective(target, head, "dflash", loss, rows, hidden, aux, steps, 8, lr, seed)


@pytest.fixture(scope="session")
def trained_dflash_head(target):
    """A one-layer DFlash head, blocks of 4 (a chain of at most 3 per round)."""
    return train_dflash_head(target)


@pytest.fixture(scope="session")
def random_dflash_head(target):
    """An untrained two-layer DFlash head (fixed seed), blocks of 6, reading target layers 1 and 2, its
    norms away from 1 (so a wrongly applied norm shows)."""
    return untrained_dflash_head(target, 6, seed=4)
