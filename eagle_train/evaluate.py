"""Stage 3, `python -m eagle_train.evaluate draft.path=DIR bench=mt_bench` (`make eval`).

Loads the target and a draft head (this project's checkpoint, an exported layout or a reference head),
then answers every question of every benchmark with every method in turn (ar first: the baseline, timed
in the same harness and the same run, interleaved with the others so load on the machine hits all
alike). Multi-turn questions (mt_bench) are asked turn by turn, each method keeping its own earlier
answers in context. Prompts longer than the context allows (target max length - max_new_tokens) keep
their first token and their end. Writes to `out_dir`:

    answers.jsonl    one record per (bench, question, turn, method): tokens, text, per-round statistics
    report.json/.md  per bench and method: tau, acceptance by position, tokens/s, speedup, greedy identity
                     (identical / near-tie / real divergence: eagle_train.decoding.identity)
    *.png            acceptance by position, tau histogram, calibration, speedup by benchmark
    serving/         (engine_concurrency) vLLM's serving benchmark: its result file per server and level;
                     the servers' logs vllm_serve_{plain,head}.log beside report.md (docs/serving-under-load.md)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eagle_train.autotune.budget import Budget
from eagle_train.autotune.costs import choose_threads
from eagle_train.autotune.shapes import tune_shapes
from eagle_train.cli import stage_lock, stage_main
from eagle_train.config.decode import AUTO_TREE_BASE, load_tree_paths
from eagle_train.config.evaluate import EvaluateConfig
from eagle_train.data.prompts import Question, bench_name, load_questions
from eagle_train.data.render import ChatRenderer
from eagle_train.decoding.decoder import SpeculativeDecoder, chain_depth
from eagle_train.decoding.identity import check_against_model, classify_answer
from eagle_train.decoding.stats import GenerationStats, mean_accept_length
from eagle_train.engines.vllm_engine import (
    EngineError,
    check_engine_python,
    run_vllm,
    run_vllm_server,
    speculative_config,
)
from eagle_train.engines.vllm_sweep import serving_sweep
from eagle_train.interop.layouts import export_head, load_draft, other_target
from eagle_train.interop.reexpress import widen_head
from eagle_train.modeling.hf_generate import HFGenerate
from eagle_train.modeling.target import Target, load_target
from eagle_train.report.engine_section import engine_section
from eagle_train.report.results import BASELINE, markdown_table, summarize, write_report
from eagle_train.report.shape_section import shape_section
from eagle_train.runtime.atomic_files import atomic_write_lines, cache_dir, read_json, remove_partial_files
from eagle_train.runtime.errors import InputError

log = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    """`auto` -> cuda when available, else cpu; anything else as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def evaluated_methods(cfg: EvaluateConfig, target: Target) -> list[str]:
    """cfg.methods, plus `hf` when decode-time forwards cannot use the target's own attention (e.g.
    flash_attention_2 takes no tree mask: ar and the trees run sdpa): HF generate then shows how fast
    plain decoding runs on the target's own kernel, next to the ar baseline."""
    methods = list(cfg.methods)
    if target.decode_attention != target.attention and "hf" not in methods:
        methods.append("hf")
    return methods


def make_decoders(
    cfg: EvaluateConfig, target: Target, head, shapes: dict[str, dict] | None = None
) -> dict[str, SpeculativeDecoder | HFGenerate]:
    """One decoder per method (ar first when present); `shapes`: method -> the DecodeConfig fields of the
    shape chosen for it (decode.shape=auto)."""
    decoders: dict[str, SpeculativeDecoder | HFGenerate] = {}
    for method in sorted(evaluated_methods(cfg, target), key=lambda m: m != BASELINE):
        chosen = (shapes or {}).get(method)
        decode = dataclasses.replace(
            cfg.decode, method=method, **({"shape": "fixed", **chosen} if chosen else {})
        )
        decoders[method] = (
            HFGenerate(target, decode) if method == "hf" else SpeculativeDecoder(target, head, decode)
        )
    return decoders


def load_head(cfg: EvaluateConfig, target: Target):
    """The draft head when a method needs one (else None)."""
    needs_head = any(m not in ("ar", "hf") for m in evaluated_methods(cfg, target))
    return load_draft(cfg.draft.path, target, mask_token_id=cfg.draft.mask_token_id) if needs_head else None


def tune_bench(
    bench: str, cfg: EvaluateConfig, target: Target, head, renderer: ChatRenderer, prompt_limit: int
) -> dict | None:
    """decode.shape=auto: the fastest predicted shape of each auto method on this benchmark, calibrated on
    held-out questions (the ones after the first num_questions; the first ones when none are left), with
    the cost curves cached under out_dir/costs (eagle_train.autotune.shapes.tune_shapes). None when no
    evaluated method is auto."""
    # (engine=vllm compares vLLM's chain of decode.chain_length with the built-in one: EvaluateConfig pins it)
    auto = [m for m in cfg.decode.auto_methods if m in cfg.methods]
    if not auto:
        return None
    questions = load_questions(bench, None, 1)
    held_out = questions[cfg.num_questions or len(questions) :][: cfg.tune_prompts]
    pool = held_out or questions[: cfg.tune_prompts]
    prompts = [
        fit_prompt(renderer.render_prompt([{"role": "user", "content": q.turns[0]}]), prompt_limit)[0]
        for q in pool
    ]
    tokens = min(cfg.tune_tokens, cfg.decode.max_new_tokens)
    base = load_tree_paths(AUTO_TREE_BASE) if "static_tree" in auto else None
    choice, costs, info = tune_shapes(
        target,
        head,
        prompts,
        tokens,
        cache_dir() / "costs",  # reused by every run on this machine (the key says what they hold)
        lean=cfg.decode.lean_draft,
        static_base=base,
        race=cfg.tune_race if "dynamic_tree" in auto else 0,  # the race settles EAGLE-2's shape only
        budget=Budget(cfg.tune_share, eval_tokens(bench, cfg, target)),
        decisive=cfg.tune_decisive,
    )
    chosen = choice.dynamic_tree
    curve = [
        [r["total_tokens"], r["tokens_per_s"]]
        for r in sorted(choice.sweep, key=lambda r: r["total_tokens"])
        if (r["depth"], r["top_k"]) == (chosen["depth"], chosen["top_k"])
    ]
    info.update(held_out=bool(held_out), questions=[q.question_id for q in pool], tokens=tokens)
    log.info("%s: shapes chosen %s", bench_name(bench), {m: choice.decode_fields(m) for m in auto})
    if choice.verdict:
        log.warning("%s: %s", bench_name(bench), choice.verdict)
    return {
        "methods": {m: choice.decode_fields(m) for m in auto},
        "choice": choice.to_dict(),
        "costs": costs.to_dict(),
        "curve": curve,
        "info": info,
    }


def eval_tokens(bench: str, cfg: EvaluateConfig, target: Target) -> int:
    """Tokens the evaluation of `bench` decodes at most: its answers (every evaluated turn, the warm-up
    questions' first turns) x methods x max_new_tokens (the tuning budget's measure, autotune.budget)."""
    questions = load_questions(bench, cfg.num_questions, cfg.max_turns)
    answers = sum(len(q.turns) for q in questions) + min(cfg.warmup, len(questions))
    return answers * len(evaluated_methods(cfg, target)) * cfg.decode.max_new_tokens


def fit_prompt(ids: list[int], limit: int) -> tuple[list[int], int]:
    """Keep the first token (BOS / template start) and the last `limit - 1` tokens; return (ids, tokens cut)."""
    if len(ids) <= limit:
        return ids, 0
    return ids[:1] + ids[len(ids) - (limit - 1) :], len(ids) - limit


def calibration_pairs(stats: GenerationStats) -> list[list[float]]:
    """[confidence, accepted] of every draft node whose parent was accepted (so the node was really
    tested against the target), chains and trees alike."""
    return [
        [confidence, int(accepted)]
        for confidence, accepted, tested in zip(
            stats.node_confidence, stats.node_accepted, stats.node_parent_accepted, strict=False
        )
        if tested
    ]


def answer_record(result, method: str, wall_s: float) -> dict:
    """The statistics part of an answers.jsonl record."""
    stats = result.stats
    rounds = stats.accepted_per_round
    return {
        "method": method,
        "new_tokens": len(result.tokens),
        "wall_s": wall_s,
        "stop_reason": result.stop_reason,
        # plain decoding: every token is a round of one; speculative: accepted drafts + 1 per round
        "accept_lengths": [a + 1 for a in rounds] if rounds else [1] * len(result.tokens),
        "draft_depths": list(stats.tree_depth_per_round) if rounds else [0] * len(result.tokens),
        "confidence": calibration_pairs(stats),
        "time_draft": stats.time_draft,
        "time_verify": stats.time_verify,
        "time_target_forward": stats.time_target_forward,
        "time_draft_forward": stats.time_draft_forward,
        "tokens": result.tokens,
    }


def answer_question(
    decoders: dict[str, SpeculativeDecoder | HFGenerate],
    renderer: ChatRenderer,
    question: Question,
    prompt_limit: int,
    classify: Callable[[list[int], list[int], list[int]], dict] | None = None,
) -> list[dict]:
    """Answer every turn of `question` with every method; each method keeps its own answers in context.
    Greedy answers are checked against ar's (`check_identity`, differing ones classified by `classify`)."""
    tokenizer = renderer.tokenizer
    greedy = next(iter(decoders.values())).cfg.temperature == 0
    history = {m: [] for m in decoders}  # method -> messages so far
    records = []
    for turn, text in enumerate(question.turns):
        prompts, turn_records = {}, []
        for method, decoder in decoders.items():
            history[method].append({"role": "user", "content": text})
            ids, cut = fit_prompt(renderer.render_prompt(history[method]), prompt_limit)
            start = time.perf_counter()
            result = decoder.generate(ids)
            wall = time.perf_counter() - start
            answer = tokenizer.decode(result.tokens, skip_special_tokens=True)
            history[method].append({"role": "assistant", "content": answer})
            record = {
                "question_id": question.question_id,
                "category": question.category,
                "turn": turn,
                "prompt_tokens": len(ids),
                "prompt_cut": cut,
                **answer_record(result, method, wall),
                "prompt_ids": list(ids),
            }
            record["text"] = answer
            prompts[method] = ids
            turn_records.append(record)
        records += check_identity(turn_records, prompts, greedy, classify)
    return records


def check_identity(
    records: list[dict],
    prompts: dict[str, list[int]],
    greedy: bool,
    classify: Callable[[list[int], list[int], list[int]], dict] | None = None,
) -> list[dict]:
    """Set `identical` on each greedy non-baseline record of one turn: its tokens equal ar's for the same
    prompt (None: the baseline, no ar in the run, sampling, or a prompt that differs from ar's because an
    earlier turn parted from it: `identity` = "prompt_differs"). A differing answer gets `divergence`:
    `classify(prompt, ar_tokens, tokens)` (near-tie or real divergence, eagle_train.decoding.identity)."""
    baseline = next((r for r in records if r["method"] == BASELINE), None)
    for r in records:
        r["identical"] = None
        if not greedy or baseline is None or r is baseline:
            continue
        if prompts[r["method"]] != prompts[BASELINE]:
            r["identity"] = "prompt_differs"
            continue
        r["identical"] = r["tokens"] == baseline["tokens"]
        if not r["identical"] and classify is not None:
            r["divergence"] = classify(prompts[BASELINE], baseline["tokens"], r["tokens"])
    return records


def divergence_classifier(target: Target, ulps: int) -> Callable[[list[int], list[int], list[int]], dict]:
    """classify(prompt, ar_tokens, tokens) for a differing answer: where it parts from ar's and whether that
    is a near-tie (decoding.identity), from the target's logits on the common prefix."""

    def classify(prompt: list[int], reference: list[int], tokens: list[int]) -> dict:
        return classify_answer(prompt, reference, tokens, target.next_logits, target.dtype, ulps)

    return classify


def check_model_identity(records: list[dict], target: Target, ulps: int) -> None:
    """Set `model_check` on every greedy answer: is each token the MODEL's own choice, by a teacher-forced
    cache-free forward of the target (decoding.identity.check_against_model)? One forward per distinct
    (prompt, answer): answers equal to ar's share its check."""

    def sequence_logits(ids: list[int]) -> torch.Tensor:
        return target.features(torch.tensor([ids], device=target.device))[0][0]

    done: dict[tuple[tuple[int, ...], tuple[int, ...]], dict] = {}
    for r in records:
        key = (tuple(r["prompt_ids"]), tuple(r["tokens"]))
        if key not in done:
            done[key] = check_against_model(r["prompt_ids"], r["tokens"], sequence_logits, target.dtype, ulps)
        r["model_check"] = done[key]


def evaluate_bench(
    bench: str, cfg: EvaluateConfig, decoders, renderer, prompt_limit: int, classify=None
) -> list[dict]:
    """All records of one benchmark (decoded once untimed for `cfg.warmup` questions first)."""
    name = bench_name(bench)
    questions = load_questions(bench, cfg.num_questions, cfg.max_turns)
    for question in questions[: cfg.warmup]:
        answer_question(decoders, renderer, Question(question.question_id, question.turns[:1]), prompt_limit)
    records = []
    bar = tqdm(questions, desc=f"eval {name}", unit="q", disable=not cfg.progress)
    for question in bar:
        for r in answer_question(decoders, renderer, question, prompt_limit, classify):
            records.append({"bench": name, **r})
        bar.set_postfix(tau=_running_tau(records))
    return records


def _running_tau(records: list[dict]) -> str:
    tau = mean_accept_length(x for r in records if r["method"] != BASELINE for x in r["accept_lengths"])
    return "-" if tau is None else f"{tau:.2f}"


def write_answers(records: list[dict], path: Path) -> None:
    """answers.jsonl, written to a temporary name then renamed."""
    atomic_write_lines(path, (json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def export_for_vllm(head, target: Target, out: Path) -> Path:
    """The head in vLLM's layout, re-expressed with the target's head_dim when the target was
    (eagle_train.interop.reexpress: vLLM's CPU attention needs 32+)."""
    target_head_dim = int(
        getattr(target.config, "head_dim", None) or target.hidden_size // target.config.num_attention_heads
    )
    if head.config.head_dim != target_head_dim:
        head = widen_head(head, target_head_dim)
    return export_head(head, "vllm", out, meta={"target": target.cfg.name, "target_source": target.source})


def run_engine(
    cfg: EvaluateConfig, target: Target, head_dir: Path | None, records: list[dict], out: Path
) -> tuple[list[dict], list[str]]:
    """The chain records' prompt token ids decoded by vLLM without and with speculation (K =
    decode.chain_length; the head as exported to `head_dir`, or as served at engine_url); returns
    (engine records, notes about vLLM's log)."""
    chain = [r for r in records if r["method"] == "chain"]
    prompts = [r["prompt_ids"] for r in chain]
    limits = dict(max_tokens=cfg.decode.max_new_tokens, stop_token_ids=target.stop_token_ids)
    if cfg.engine_url:
        result = run_vllm_server(cfg.engine_url, prompts, **limits)
    else:
        runs = {"ar": None, "chain": speculative_config(head_dir, cfg.decode.chain_length)}
        result = run_vllm(
            target.source,
            prompts,
            runs,
            out / "engine",
            max_model_len=target.max_len,
            python=cfg.engine_python,
            dtype=cfg.target.dtype if cfg.target.dtype != "auto" else "auto",
            **limits,
        )
    engine_records = []
    for name in result.runs:
        for source, answer in zip(chain, result.outputs(name), strict=True):
            engine_records.append(
                {
                    "bench": source["bench"],
                    "question_id": source["question_id"],
                    "turn": source["turn"],
                    "engine": "vllm",
                    "method": name,
                    "new_tokens": len(answer["tokens"]),
                    "wall_s": answer["wall_s"],
                    "tokens": answer["tokens"],
                    "spec": answer["spec"],
                }
            )
    notes = [
        f"vllm {run.name}: the log reports a weight-loading problem: {w}"
        for run in result.runs.values()
        for w in run.load_warnings
    ]
    return engine_records, notes


def engine_sections(
    cfg: EvaluateConfig, target: Target, head, records: list[dict], out: Path, classify
) -> tuple[dict | None, dict | None, EngineError | None]:
    """engine=vllm: the report's engine section (one request at a time, engine_answers.jsonl), and with
    engine_concurrency its serving section; a failed serving sweep is returned (the finished evaluation's
    report is written first, then it is raised) and noted in the engine section."""
    if cfg.engine != "vllm":
        return None, None, None
    head_dir = None if cfg.engine_url else export_for_vllm(head, target, out / "engine" / "vllm_head")
    engine_records, log_notes = run_engine(cfg, target, head_dir, records, out)
    write_answers(engine_records, out / "engine_answers.jsonl")
    engines = engine_section(records, engine_records, out, cfg.decode.chain_length, plots=cfg.plots)
    engines["sanity"] = log_notes + block_notes(head, cfg.decode.chain_length) + engines["sanity"]
    if not cfg.engine_concurrency:
        return engines, None, None
    try:
        return engines, serving_sweep(cfg, target, head_dir, records, out, classify), None
    except EngineError as err:
        engines["sanity"].append(f"the serving sweep failed: {str(err).splitlines()[0]}")
        return engines, None, err


def block_notes(head, chain_length: int) -> list[str]:
    """Why a DFlash head's counters differ in vLLM at K < B - 1: its blocks are K + 1 slots (docs/dflash.md)."""
    k = chain_depth(head, chain_length)
    if not getattr(head, "drafts_block", False) or k == head.block_size - 1:
        return []
    return [
        f"a DFlash head drafting K = {k} of its block's {head.block_size - 1} mask slots: vLLM drafts from a "
        f"block of K + 1 = {k + 1} slots, the built-in decoder from the trained {head.block_size}, so their "
        f"acceptance differs by design (greedy output does not); decode.chain_length={head.block_size - 1} "
        "compares the same blocks"
    ]


def draft_notes(cfg: EvaluateConfig, target: Target) -> list[str]:
    """A report warning when the head was trained for another target (eagle_train.interop.layouts)."""
    config = Path(cfg.draft.path or "") / "config.json"
    if not cfg.draft.path or not config.is_file():
        return []
    meta = read_json(config, "draft head config").get("eagle_train", {})
    why = other_target(meta if isinstance(meta, dict) else {}, target)
    return [f"draft head {cfg.draft.path}: {why}"] if why else []


def run_meta(cfg: EvaluateConfig, target: Target, device: torch.device, seconds: float) -> dict:
    """The run settings shown at the top of the report."""
    decode = {k: v for k, v in dataclasses.asdict(cfg.decode).items() if k not in ("method", "tree_paths")}
    return {
        "target": f"{cfg.target.name} ({target.source})",
        "draft": cfg.draft.path,
        "benchmarks": ", ".join(bench_name(b) for b in cfg.bench),
        "methods": ", ".join(evaluated_methods(cfg, target)),
        "attention": attention_meta(target),
        "engines": "builtin"
        + (
            f", vllm ({cfg.engine_url or 'started from ' + str(cfg.engine_python or '.venv-vllm')})"
            if cfg.engine == "vllm"
            else ""
        ),
        "temperature": cfg.decode.temperature,
        "target_dtype": str(target.dtype).removeprefix("torch."),
        "near_tie_ulps": cfg.near_tie_ulps,
        "decode": json.dumps(decode),
        "num_questions": cfg.num_questions,
        "device": f"{device} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "eval_seconds": round(seconds, 1),
    }


def pick_threads(cfg: EvaluateConfig, target: Target) -> str:
    """num_threads=null on a CPU: the faster of one thread and torch's default for the target's forwards,
    measured (eagle_train.autotune.costs.choose_threads); returns how the thread count was set."""
    if cfg.num_threads:
        return f"{cfg.num_threads} (num_threads)"
    default = torch.get_num_threads()
    if target.device.type != "cpu" or default == 1:
        return f"{default} (torch's default)"
    context = min(128, target.max_len // 2)
    found = choose_threads(target, context, min(32, target.max_len - context), sorted({1, default}))
    timings = ", ".join(
        f"{t} thread{'s' * (t > 1)}: {one * 1e3:.2f} / {many * 1e3:.2f} ms"
        for t, (one, many) in found["seconds"].items()
    )
    return f"{found['threads']} (measured: target forward of 1 / 32 tokens, {timings})"


def attention_meta(target: Target) -> str:
    """The attention kernels of the run: decode-time forwards (ar, chain, static_tree, dynamic_tree) and HF generate."""
    own, decode = target.attention, target.decode_attention
    if own == decode:
        return own
    return f"{decode} for ar/chain/static_tree/dynamic_tree (the tree mask needs it), {own} for hf"


def run(cfg: EvaluateConfig) -> dict:
    """Evaluate the head on every benchmark with every method; write answers, report and plots (under an
    exclusive lock on out_dir, eagle_train.runtime.output_lock)."""
    with stage_lock(cfg.out_dir, "evaluate"):
        if Path(cfg.out_dir).is_dir():  # what a killed run's writes left (its own files only)
            for name in ("answers.jsonl", "engine_answers.jsonl", "report.json", "report.md", "*.png"):
                remove_partial_files(cfg.out_dir, name)
        return evaluate(cfg)


def evaluate(cfg: EvaluateConfig) -> dict:
    """The stage under its lock."""
    if cfg.engine == "vllm" and not cfg.engine_url:  # before any work: a broken engine stops it at once
        check_engine_python(cfg.engine_python)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device = pick_device(cfg.device)
    start = time.perf_counter()
    target = load_target(cfg.target, device)
    threads = pick_threads(cfg, target)
    head = load_head(cfg, target)
    renderer = ChatRenderer(target.tokenizer, cfg.target, target.max_len)
    prompt_limit = target.max_len - cfg.decode.max_new_tokens
    if prompt_limit < 2:
        raise InputError(
            f"decode.max_new_tokens={cfg.decode.max_new_tokens} leaves no room for a prompt in "
            f"{cfg.target.name}'s context of {target.max_len} tokens"
        )
    classify = divergence_classifier(target, cfg.near_tie_ulps)
    records, tuning = [], {}
    for bench in cfg.bench:
        tuned = tune_bench(bench, cfg, target, head, renderer, prompt_limit)
        decoders = make_decoders(cfg, target, head, tuned["methods"] if tuned else None)
        bench_start = time.perf_counter()
        bench_records = evaluate_bench(bench, cfg, decoders, renderer, prompt_limit, classify)
        if tuned:  # what the tuning cost against the evaluation it served, measured
            tuned["info"]["budget"]["eval_s"] = time.perf_counter() - bench_start
        if cfg.check_model and cfg.decode.temperature == 0:
            check_model_identity(bench_records, target, cfg.near_tie_ulps)
        records += bench_records
        if tuned:
            tuning[bench_name(bench)] = tuned
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_answers(records, out / "answers.jsonl")
    engines, serving, failed = engine_sections(cfg, target, head, records, out, classify)
    meta = run_meta(cfg, target, device, time.perf_counter() - start)
    meta["threads"] = threads
    report = write_report(
        records,
        out,
        meta,
        min_rounds=cfg.min_rounds,
        plots=cfg.plots,
        engines=engines,
        notes=draft_notes(cfg, target),
        shapes=shape_section(tuning, summarize(records), out, cfg.plots, threads) if tuning else None,
        serving=serving,
    )
    cut = sum(1 for r in records if r["prompt_cut"])
    if cut:
        log.warning("%d prompts were longer than the context allows and were cut (see prompt_cut)", cut)
    print(markdown_table(report["results"]))
    for section in (engines, serving):
        if section:
            print(section["markdown"])
    for note in report["sanity"]:
        print(f"WARNING: {note}")
    for line in report["identity"]:
        print(line)
    print(f"report: {out / 'report.md'}")
    if failed:
        raise failed
    return report


main = stage_main("evaluate", run)


if __name__ == "__main__":
    main()
