"""Heads' first draft position, teacher-forced on the target's own greedy answers (stories260K).

    python scripts/bench_first_position.py NAME=HEAD_DIR [NAME=HEAD_DIR ...] [--questions 20] [--out FILE]

The target answers the first `--questions` TinyStories prompts and mt_bench first turns greedily (128 new
tokens, plain decoding); each head then runs ONE causal forward over every (feature, token) pair of prompt +
answer, the target's own features (its last hidden state, or the inputs of its aux layers for EAGLE-3 and
P-EAGLE heads), and its top-1 draft at each pair is compared with the target's next token at every answer
position after the first. That is the first position of every round, drafted from the real pair (P-EAGLE's
depth 0, EAGLE-3's first step), at EVERY position, where the decoder's first-position acceptance counts only
the positions where rounds start (right after a rejected draft: the harder spots). Prints and writes (--out,
JSON) the top-1 rate per benchmark and head.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eagle_train.config.base import CONF_DIR, to_schema
from eagle_train.config.decode import DecodeConfig
from eagle_train.config.target import TargetConfig
from eagle_train.data.prompts import load_questions
from eagle_train.data.render import ChatRenderer
from eagle_train.decoding.decoder import SpeculativeDecoder, head_reads
from eagle_train.evaluate import fit_prompt
from eagle_train.interop.layouts import load_draft
from eagle_train.modeling.target import load_target

BENCHES = ("tinystories", "mt_bench")
NEW_TOKENS = 128


@torch.no_grad()
def first_position_top1(target, head, answers: list[tuple[list[int], list[int]]]) -> dict:
    """Teacher-forced top-1 of the head's draft from the real pair at every answer position after the first."""
    aux_layers, vocab_map = head_reads(head, target.device)
    dtype, hits, total = next(head.parameters()).dtype, 0, 0
    for prompt, answer in answers:
        ids = torch.tensor([prompt + answer], device=target.device)
        if aux_layers:
            _, features = target.aux_hidden_states(ids, None, aux_layers)
        else:
            features = target.hidden_states(ids)
        # pair j = (f_j, t_{j+1}) drafts t_{j+2}; causal over the whole sequence (the decoder's catch-up)
        states = head(ids[:, 1:], features[:, :-1].to(dtype))
        draft = head.logits(states)[0].argmax(-1)
        draft = draft if vocab_map is None else vocab_map[draft]
        first = len(prompt) - 1  # pair (f_{P-1}, t_P) drafts t_{P+1}, the answer's second token
        hits += int((draft[first:-1] == ids[0, first + 2 :]).sum())  # the last pair drafts past the end
        total += ids.shape[1] - 2 - first
    return {"top1": hits / total, "positions": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads", nargs="+", help="NAME=HEAD_DIR")
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    heads = dict(spec.split("=", 1) for spec in args.heads)
    target = load_target(to_schema(OmegaConf.load(CONF_DIR / "target" / "stories260k.yaml"), TargetConfig))
    renderer = ChatRenderer(target.tokenizer, target.cfg, target.max_len)
    plain = SpeculativeDecoder(target, None, DecodeConfig(method="ar", max_new_tokens=NEW_TOKENS))
    loaded = {name: load_draft(path, target) for name, path in heads.items()}
    results = {}
    for bench in BENCHES:
        answers = []
        for question in load_questions(bench, args.questions, 1):
            chat = [{"role": "user", "content": question.turns[0]}]
            prompt = fit_prompt(renderer.render_prompt(chat), target.max_len - NEW_TOKENS)[0]
            answers.append((list(prompt), plain.generate(prompt).tokens))
        for name, head in loaded.items():
            results.setdefault(name, {})[bench] = found = first_position_top1(target, head, answers)
            print(
                f"{bench:12s} {name:16s} first-position top-1 {found['top1']:.3f} ({found['positions']} positions)"
            )
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
