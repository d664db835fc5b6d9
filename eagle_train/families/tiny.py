"""Tiny instances of the model families (eagle_train.families.specs), saved as ordinary HF model directories.

    python -m eagle_train.families.tiny FAMILY [FAMILY ...]      builds (or finds) them; prints their paths

`build_family(name)` makes the family's config with transformers' own config class (a few layers, hidden 64,
the real vocabulary size and switches), initialises it at random (seeded) and then SHAPES it: a random
transformer's greedy output is not something a draft head can learn, so the model is trained briefly on
TinyStories conversations rendered with its own chat template and tokenizer (`shape_steps` AdamW steps, the
loss over every token, the softmax restricted to the token ids that occur in that text: a full 128k-262k
vocabulary would cost 20-40x more per step and the other rows are never a greedy choice after shaping, which
`build_family` checks). The directory holds config.json, generation_config.json (the published eos/bos ids),
model.safetensors, the tokenizer files (+ chat_template.jinja) and shaping.json (steps, loss, timings).

Built models are cached outside git ($EAGLE_TRAIN_CACHE/models/NAME-KEY), KEY a hash of the family's spec,
the build settings, the tokenizer's pinned sha256 and this package's builder sources: a change to any of them
builds anew.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers

from eagle_train.config.base import data_path
from eagle_train.families.specs import FAMILIES, TINY, Family
from eagle_train.families.tokenizers import TOKENIZERS, fetch_tokenizer
from eagle_train.runtime.atomic_files import atomic_write_dir, cache_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
BUILDER_SOURCES = ("specs.py", "tiny.py", "tokenizers.py")


@dataclass(frozen=True)
class BuildSettings:
    """How a tiny instance is made (part of its cache key)."""

    seed: int = 0
    shape_steps: int = 200  # AdamW steps on TinyStories conversations (0: the random model as is)
    shape_lr: float = 3e-3
    shape_batch: int = 16  # conversations per step
    shape_max_len: int = 160  # tokens per conversation (the rest is cut)
    conversations: int = 1500  # the first N of data/tinystories/tinystories_sharegpt.jsonl
    unused_logit: float = -12.0  # the mean logit given to ids that never occur (push_unused_rows)


def family_config(family: Family):
    """The family's transformers config: TINY, the family's fields, its vocabulary and ids."""
    cls = getattr(transformers, family.config_class)
    eos = family.eos_token_ids
    return cls(
        **{**TINY, **family.fields},
        vocab_size=family.vocab_size,
        bos_token_id=family.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else eos,
        pad_token_id=family.pad_token_id,
    )


def cache_key(family: Family, settings: BuildSettings) -> str:
    """A hash of everything the built model depends on."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    h.update(
        json.dumps(
            [asdict(family), asdict(settings), TOKENIZERS[family.tokenizer].sha256], sort_keys=True
        ).encode()
    )
    h.update(transformers.__version__.encode())
    for name in BUILDER_SOURCES:
        h.update((here / name).read_bytes())
    return h.hexdigest()[:12]


def model_dir(name: str, settings: BuildSettings = BuildSettings(), cache: Path | None = None) -> Path:
    """Where `build_family(name, settings)` puts the model."""
    return (cache or cache_dir()) / "models" / f"{name}-{cache_key(FAMILIES[name], settings)}"


def build_family(name: str, settings: BuildSettings = BuildSettings(), cache: Path | None = None) -> Path:
    """The model directory of family `name`, built on first use (tokenizer fetched, model shaped)."""
    if name not in FAMILIES:
        raise KeyError(f"unknown family {name!r}; known: {sorted(FAMILIES)}")
    final = model_dir(name, settings, cache)
    if (final / "shaping.json").is_file():
        return final
    family, tok_dir = FAMILIES[name], fetch_tokenizer(FAMILIES[name].tokenizer, cache)
    final.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_dir(final, lambda out: _build(family, settings, tok_dir, out))
    return final


def _build(family: Family, settings: BuildSettings, tok_dir: Path, out: Path) -> None:
    start = time.perf_counter()
    for f in TOKENIZER_FILES:
        if (tok_dir / f).is_file():
            shutil.copyfile(tok_dir / f, out / f)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    if len(tokenizer) > family.vocab_size:
        raise ValueError(
            f"{family.name}: tokenizer has {len(tokenizer)} tokens > vocab_size {family.vocab_size}"
        )
    torch.manual_seed(settings.seed)
    config = family_config(family)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    built = time.perf_counter()
    report = shape(model, tokenizer, settings)
    report.update(build_s=round(built - start, 2), family=family.name, settings=asdict(settings))
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=family.bos_token_id,
        eos_token_id=family.eos_token_ids,
        pad_token_id=family.pad_token_id,
    )
    model.save_pretrained(out)
    (out / "shaping.json").write_text(json.dumps(report, indent=2) + "\n")


def conversations(limit: int) -> list[list[dict]]:
    """The first `limit` TinyStories conversations as chat messages (user: first sentence; assistant: rest)."""
    path = data_path("tinystories/tinystories_sharegpt.jsonl")
    roles = {"human": "user", "gpt": "assistant"}
    out = []
    for line in path.read_text(encoding="utf-8").splitlines()[:limit]:
        turns = json.loads(line)["conversations"]
        out.append([{"role": roles[t["from"]], "content": t["value"]} for t in turns])
    return out


def render_ids(tokenizer, chats: list[list[dict]], max_len: int) -> list[list[int]]:
    """Each conversation rendered by the tokenizer's chat template, tokenised, cut to max_len."""
    ids = []
    for chat in chats:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"][:max_len])
    return ids


def shape(model, tokenizer, settings: BuildSettings) -> dict:
    """Train `model` in place on TinyStories conversations; returns what was done. Only the embedding and
    LM-head rows of the ids that occur are trained (a [k, d] copy swapped in for the step, written back):
    AdamW over a 128k-262k x 64 table every step would cost more than the rest of the model."""
    if settings.shape_steps == 0:
        return {"steps": 0}
    start = time.perf_counter()
    seqs = render_ids(tokenizer, conversations(settings.conversations), settings.shape_max_len)
    keep = torch.tensor(sorted({t for s in seqs for t in s}))  # [k] the ids that occur
    remap = torch.zeros(model.config.vocab_size, dtype=torch.long)
    remap[keep] = torch.arange(len(keep))
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    full_embed, full_head = embed.weight, head.weight
    tied = full_embed is full_head
    small_embed = torch.nn.Parameter(full_embed.detach()[keep].clone())  # [k, d]
    small_head = small_embed if tied else torch.nn.Parameter(full_head.detach()[keep].clone())
    embed.weight, padding_idx = small_embed, getattr(embed, "padding_idx", None)
    embed.padding_idx = None  # an id of the full table (e.g. Qwen's 151643), not a row of the small one
    others = [p for n, p in model.named_parameters() if p is not small_embed and p is not full_head]
    params = [*others, small_embed] + ([] if tied else [small_head])
    try:
        losses = _train(model, seqs, remap, small_head, params, settings)
    finally:
        with torch.no_grad():
            full_embed[keep] = small_embed.detach()
            full_head[keep] = small_head.detach()
        embed.weight, embed.padding_idx = full_embed, padding_idx
    unused_logit = push_unused_rows(model, keep, seqs, settings)
    return {
        "steps": settings.shape_steps,
        "kept_ids": len(keep),
        "unused_logit": unused_logit,
        "loss_first": round(sum(losses[:10]) / min(10, len(losses)), 3),
        "loss_last": round(sum(losses[-10:]) / min(10, len(losses)), 3),
        "shape_s": round(time.perf_counter() - start, 2),
    }


def push_unused_rows(model, keep: torch.Tensor, seqs: list[list[int]], settings: BuildSettings) -> float:
    """Give the LM-head rows of ids that never occur a negative logit on every position of the text.
    Shaping trains only the kept rows; the 120k-260k others kept logits near 0 while the greedy token's is
    about 7, so the greedy token held about 1% of the probability and a draft's node values (EAGLE-2's
    products of probabilities) were flat: its trees stayed two levels deep. A direction v with h . v > 0
    for the final hidden states h of a sample of the text is fitted (logistic loss, 64 parameters, LBFGS),
    and every unused row becomes -s * v, s giving them a mean logit of `settings.unused_logit`; those ids
    never occur as inputs, so a tied table changes nothing else. Returns the largest unused logit on the
    sample (negative when v separates every hidden state; recorded in shaping.json)."""
    head = model.get_output_embeddings().weight  # [vocab, d]
    sample = [seqs[i] for i in range(0, len(seqs), max(1, len(seqs) // 64))][:64]
    ids, mask = _pad(sample, pad=0)
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]  # [n, d]
    direction = torch.zeros(hidden.shape[1], requires_grad=True)
    fit = torch.optim.LBFGS([direction], max_iter=200)

    def loss() -> torch.Tensor:
        fit.zero_grad()
        value = torch.nn.functional.softplus(-(hidden @ direction)).mean() + 1e-4 * direction.square().sum()
        value.backward()
        return value

    fit.step(loss)
    with torch.no_grad():
        projection = hidden @ direction  # [n]
        scale = settings.unused_logit / float(projection.mean())
        unused = torch.ones(head.shape[0], dtype=torch.bool)
        unused[keep] = False
        head[unused] = scale * direction.detach()
    return round(float(projection.min()) * scale, 2)


def _train(model, seqs, remap, head_weight, params, settings: BuildSettings) -> list[float]:
    """AdamW with a cosine decay to 10%; the loss is next-token CE over the kept ids."""
    g = torch.Generator().manual_seed(settings.seed)
    opt = torch.optim.AdamW(params, lr=settings.shape_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, settings.shape_steps, settings.shape_lr * 0.1)
    model.train()
    losses = []
    for _ in range(settings.shape_steps):
        batch = [seqs[i] for i in torch.randint(len(seqs), (settings.shape_batch,), generator=g).tolist()]
        ids, mask = _pad([remap[torch.tensor(s)].tolist() for s in batch], pad=0)
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [b, n, d]
        logits = hidden[:, :-1] @ head_weight.T  # [b, n-1, k]
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return losses


def _pad(batch: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in batch)
    ids = torch.full((len(batch), n), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, s in enumerate(batch):  # right padding
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="+", choices=sorted(FAMILIES))
    args = parser.parse_args(argv)
    for name in args.families:
        print(name, build_family(name))


if __name__ == "__main__":
    main()
