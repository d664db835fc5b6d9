"""What verifying k drafted tokens costs against one plain step, and plain decoding against HF generate, on one
target, side by side in ONE process: the eager decode-time forward and target.compile_frozen's graphs.

    python scripts/bench_verify.py [--target smollm2_135m_instruct] [--context 300] [--queries 1,2,3,4,6,8,12,16]
        [--repeats 15] [--answers 3] [--new-tokens 64] [--no-frozen] [--out bench_results/verify.json]

Cost curve: after a prefix of --context random token ids, the decode-time forward of k new tokens (a chain,
causal within the k) from the same cache each time (nothing committed), the median of --repeats timed calls
after one untimed call (which builds a frozen graph, about two minutes each on SmolLM2, and measures whether a
bucket runs whole or in chunks of a smaller one). Printed in ms and as
cost(k) / cost(1) of the same forward: speculation pays only where that ratio stays near 1.
Plain decoding: `ar` on each forward and `hf` (HF generate) answer the first --answers mt_bench first turns
(--new-tokens, greedy) after one warm-up answer; tokens/s, and whether every answer equals hf's.
One thread (torch.set_num_threads(1)); the frozen target shares the eager one's weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eagle_train.config.base import CONF_DIR, to_schema
from eagle_train.config.decode import DecodeConfig
from eagle_train.config.target import TargetConfig
from eagle_train.data.prompts import Question, load_questions
from eagle_train.data.render import ChatRenderer
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.evaluate import answer_question
from eagle_train.modeling.hf_generate import HFGenerate
from eagle_train.modeling.target import load_target


def forward_ms(target, reference, context: int, queries: int, repeats: int) -> float:
    """Median ms of `target.decode` of `queries` chained tokens after `context` tokens (prefilled by
    `reference`, the eager target: the frozen graphs serve only forwards after a prompt)."""
    g = torch.Generator().manual_seed(queries)
    vocab = target.vocab_size
    prefix = torch.randint(3, vocab, (1, context), generator=g)
    ids = torch.randint(3, vocab, (1, queries), generator=g)
    positions = torch.arange(context, context + queries)[None]
    mask = torch.cat(
        [
            torch.ones(queries, context, dtype=torch.bool),
            torch.ones(queries, queries, dtype=torch.bool).tril(),
        ],
        1,
    )[None, None]
    cache = reference.new_cache(context + 32)
    reference.decode(
        prefix, torch.arange(context)[None], torch.ones(context, context).tril().bool()[None, None], cache
    )
    cache.advance(context)
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        target.decode(ids, positions, mask, cache)
        if i:  # the first call builds graphs
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def plain_decoding(targets: dict, answers: int, new_tokens: int) -> dict[str, dict]:
    """`ar` of each target and `hf` answer the first `answers` mt_bench first turns; tokens/s per decoder and
    the answers' token ids."""
    eager = targets["eager"]
    decode = DecodeConfig(method="ar", max_new_tokens=new_tokens)
    decoders = {"hf": HFGenerate(eager, replace(decode, method="hf"))}
    decoders |= {f"ar/{name}": SpeculativeDecoder(t, None, decode) for name, t in targets.items()}
    renderer = ChatRenderer(eager.tokenizer, eager.cfg, eager.max_len)
    questions = [Question(q.question_id, q.turns[:1]) for q in load_questions("mt_bench", answers + 1, 1)]
    answer_question(decoders, renderer, questions[0], eager.max_len - new_tokens)  # warm-up: graphs built
    out = {name: {"tokens": 0, "seconds": 0.0, "answers": []} for name in decoders}
    for question in questions[1:]:
        for record in answer_question(decoders, renderer, question, eager.max_len - new_tokens):
            row = out[record["method"]]
            row["tokens"] += record["new_tokens"]
            row["seconds"] += record["wall_s"]
            row["answers"].append(record["tokens"])
    for row in out.values():
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        row["identical_to_hf"] = row["answers"] == out["hf"]["answers"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="smollm2_135m_instruct", help="a preset of conf/target")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--queries", default="1,2,3,4,6,8,12,16")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--answers", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-frozen", action="store_true", help="the eager forward only (no compilation)")
    parser.add_argument("--out", type=Path, default=Path("bench_results/verify.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = to_schema(OmegaConf.load(CONF_DIR / "target" / f"{args.target}.yaml"), TargetConfig)
    eager = load_target(cfg)
    targets = {"eager": eager}
    if not args.no_frozen:
        targets["frozen"] = replace(eager, cfg=replace(eager.cfg, compile_decode=True, compile_frozen=True))
    queries = [int(q) for q in args.queries.split(",")]
    curve = []
    with torch.inference_mode():
        for k in queries:
            row = {"queries": k}
            for name, target in targets.items():
                row[f"{name}_ms"] = forward_ms(target, eager, args.context, k, args.repeats)
            curve.append(row)
            print(json.dumps(row), flush=True)
        for row in curve:
            for name in targets:
                row[f"{name}_over_one_step"] = row[f"{name}_ms"] / curve[0][f"{name}_ms"]
            if "frozen" in targets:
                row["eager_over_frozen"] = row["eager_ms"] / row["frozen_ms"]
        plain = plain_decoding(targets, args.answers, args.new_tokens)
    for row in plain.values():
        del row["answers"]
    result = {"target": args.target, "context": args.context, "threads": 1, "curve": curve, "plain": plain}
    if "frozen" in targets:  # bucket -> the chunk its forwards ran in (measured: modeling.frozen_step)
        result["frozen_chunks"] = targets["frozen"]._frozen_decoder.chunks
    result["ar_over_hf"] = {n: r["tokens_per_s"] / plain["hf"]["tokens_per_s"] for n, r in plain.items()}
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
