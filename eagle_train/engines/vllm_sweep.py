"""What a head is worth under load: vLLM's own serving benchmark at each concurrency level, against a server
without the head ("plain") and one with it ("head"), on the same requests; optionally beside servers running
vLLM's own training-free speculation ("ngram", "suffix": the baselines a head has to beat).

The servers are started here one after the other (`vllm_server`: a free port, the log kept, always
stopped), or two running servers are used as they are (then the levels interleave: plain, head, plain,
head, ...). Each (server, level) is one `vllm bench serve` run whose result file vLLM writes to
`out_dir/{server}-c{N}.json` (its console output beside it, `.log`).

The requests are the prompts given, in order, repeated from the start when more are asked for, written as
the ShareGPT JSON that vLLM's `sharegpt` dataset reads (`--disable-shuffle --no-oversample`: request i is
prompt i at every level and on both servers).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle_train.config.evaluate import EvaluateConfig
from eagle_train.engines.vllm_engine import (
    EngineError,
    baseline_speculative_config,
    engine_python,
    speculative_config,
)
from eagle_train.engines.vllm_server import free_port, run_serving_benchmark, serve_command, vllm_server
from eagle_train.report.serving_section import HEAD, PLAIN, SERVERS, compare_answers, serving_section
from eagle_train.runtime.atomic_files import atomic_write_text

if TYPE_CHECKING:
    from eagle_train.modeling.target import Target

# vLLM's sharegpt loader drops prompts outside these token counts without a word (its is_valid_sequence)
MIN_PROMPT_TOKENS, MAX_PROMPT_TOKENS, MAX_TOTAL_TOKENS = 4, 1024, 2048


@dataclass
class SweepPlan:
    """What every benchmark run of a sweep shares."""

    levels: list[int]  # concurrency levels, in the order they run
    num_prompts: int  # requests per run
    max_tokens: int  # output tokens per request at most (the evaluation's decode.max_new_tokens)
    stop_token_ids: list[int]
    tokenizer: str  # the target's tokenizer (a path: nothing comes from a hub)
    warmup: int  # untimed warm-up requests per request slot (x the concurrency) before each run


def fits_vllm_loader(prompt_tokens: int, max_tokens: int) -> bool:
    """Whether vLLM's sharegpt loader keeps a prompt of this many tokens (else it drops it silently)."""
    return (
        MIN_PROMPT_TOKENS <= prompt_tokens <= MAX_PROMPT_TOKENS
        and prompt_tokens + max_tokens <= MAX_TOTAL_TOKENS
    )


def write_requests(texts: list[str], count: int, path: Path) -> list[str]:
    """The ShareGPT JSON of `count` requests (the texts in order, repeated from the start); returns the
    prompt of each request."""
    if not texts:
        raise ValueError("no prompt for vLLM's serving benchmark")
    prompts = [texts[i % len(texts)] for i in range(count)]
    records = [
        {"id": str(i), "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": ""}]}
        for i, p in enumerate(prompts)
    ]
    atomic_write_text(path, json.dumps(records, ensure_ascii=False) + "\n")
    return prompts


def result_file(out_dir: Path, server: str, concurrency: int) -> Path:
    """Where vLLM writes the result of one (server, level)."""
    return out_dir / f"{server}-c{concurrency}.json"


def bench_level(
    server: str,
    base_url: str,
    concurrency: int,
    plan: SweepPlan,
    dataset: Path,
    out_dir: Path,
    python: str | None,
) -> dict[str, Any]:
    """One `vllm bench serve` run; its result as vLLM wrote it (checked: every request was sent)."""
    path = result_file(out_dir, server, concurrency)
    result = run_serving_benchmark(
        base_url,
        dataset,
        path,
        python=python,
        tokenizer=plan.tokenizer,
        num_prompts=plan.num_prompts,
        concurrency=concurrency,
        max_tokens=plan.max_tokens,
        stop_token_ids=plan.stop_token_ids,
        warmups=plan.warmup * concurrency,
        label=server,
    )
    sent = len(result.get("generated_texts") or [])
    if sent != plan.num_prompts:
        raise EngineError(
            f"{path}: vLLM's benchmark sent {sent} requests, not {plan.num_prompts}: its sharegpt loader "
            f"dropped prompts (it keeps {MIN_PROMPT_TOKENS}-{MAX_PROMPT_TOKENS} tokens, prompt + output <= "
            f"{MAX_TOTAL_TOKENS})"
        )
    return result


def run_sweep(
    plan: SweepPlan,
    dataset: Path,
    out_dir: Path,
    *,
    python: str | None = None,
    urls: dict[str, str] | None = None,
    commands: dict[str, Callable[[int], list[str]]] | None = None,
    log_dir: Path | None = None,
    ready_timeout_s: float = 600,
) -> dict[int, dict[str, dict]]:
    """Every level on every server: `urls` (plain, head) of running servers, or `commands` (server name ->
    port -> `vllm serve` command: plain, head, then any baselines) started here one at a time, in that order,
    their logs `log_dir/vllm_serve_{name}.log`. Returns concurrency -> {server name: result}."""
    results: dict[int, dict[str, dict]] = {c: {} for c in plan.levels}
    if urls:
        for c in plan.levels:
            for name in SERVERS:
                results[c][name] = bench_level(name, urls[name], c, plan, dataset, out_dir, python)
        return results
    if commands is None or list(commands)[:2] != list(SERVERS):
        raise ValueError("run_sweep needs the two servers' urls or their commands (plain and head first)")
    for name in commands:
        port = free_port()
        log = (log_dir or out_dir) / f"vllm_serve_{name}.log"
        with vllm_server(commands[name](port), port, log, ready_timeout_s) as base_url:
            for c in plan.levels:
                results[c][name] = bench_level(name, base_url, c, plan, dataset, out_dir, python)
    return results


# ------------------------------------------------------------------------------- evaluate engine=vllm


def prompt_text(tokenizer, ids: list[int]) -> str:
    """Prompt ids as the text a server turns back into them: the special tokens its tokenizer adds itself
    (a BOS) left out of the text."""
    full, plain = tokenizer("x").input_ids, tokenizer("x", add_special_tokens=False).input_ids
    added = full[: next((i for i in range(len(full)) if full[i : i + len(plain)] == plain), 0)]
    start = len(added) if added and ids[: len(added)] == added else 0
    return tokenizer.decode(ids[start:])


def serving_prompts(records: list[dict], tokenizer, max_tokens: int) -> tuple[list[str], list[str]]:
    """The evaluation's first-turn prompts (the `ar` records: every method shares them), as text; and notes
    on prompts vLLM's loader would drop (left out here) or that tokenize to other ids than evaluated."""
    texts, dropped, retokenized = [], 0, 0
    for r in records:
        if r["method"] != "ar" or r["turn"] != 0:
            continue
        text = prompt_text(tokenizer, r["prompt_ids"])
        ids = tokenizer(text).input_ids
        if not fits_vllm_loader(len(ids), max_tokens):
            dropped += 1
            continue
        retokenized += ids != r["prompt_ids"]
        texts.append(text)
    notes = []
    if dropped:
        notes.append(
            f"serving: {dropped} prompts left out: vLLM's benchmark loader takes {MIN_PROMPT_TOKENS}-"
            f"{MAX_PROMPT_TOKENS} prompt tokens and prompt + output <= {MAX_TOTAL_TOKENS}"
        )
    if retokenized:
        notes.append(
            f"serving: {retokenized} of {len(texts)} prompts, sent as text, tokenize to other ids than the "
            "built-in evaluation used (both servers still get the same text)"
        )
    return texts, notes


def text_classifier(
    tokenizer, classify_ids: Callable[[list[int], list[int], list[int]], dict | None]
) -> Callable[[str, str, str], dict | None]:
    """classify(prompt, plain_text, head_text) for two differing answers of the servers: `classify_ids`
    (evaluate.divergence_classifier: the target's logits at the first differing token) on the re-tokenized
    prompt + answer; "index" counts answer tokens."""

    def classify(prompt: str, reference: str, text: str) -> dict | None:
        found = classify_ids([], tokenizer(prompt + reference).input_ids, tokenizer(prompt + text).input_ids)
        if found is not None:
            found["index"] -= len(tokenizer(prompt).input_ids)
        return found

    return classify


def serve_commands(
    cfg: EvaluateConfig,
    target: Target,
    spec: dict[str, Any],
    baselines: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Callable]:
    """Server name -> port -> the `vllm serve` command of the target: without the head, with `spec`, then with
    each of `baselines` (name -> vLLM's speculative_config)."""
    python = engine_python(cfg.engine_python)

    def command(speculative: dict | None) -> Callable[[int], list[str]]:
        return lambda port: serve_command(
            python,
            target.source,
            port,
            dtype=cfg.target.dtype,
            max_model_len=target.max_len,
            speculative=speculative,
            extra_args=cfg.engine_serve_args,
        )

    return {
        PLAIN: command(None),
        HEAD: command(spec),
        **{name: command(config) for name, config in (baselines or {}).items()},
    }


def serving_sweep(
    cfg: EvaluateConfig,
    target: Target,
    head_dir: Path | None,
    records: list[dict],
    out: Path,
    classify_ids: Callable[[list[int], list[int], list[int]], dict | None] | None = None,
) -> dict[str, Any]:
    """`evaluate engine=vllm engine_concurrency=[...]`: the sweep on the evaluation's first-turn prompts, on
    servers started here (the target, and the target with the head exported to `head_dir`) or on
    engine_plain_url / engine_url; returns the report's serving section (eagle_train.report.serving_section)."""
    texts, notes = serving_prompts(records, target.tokenizer, cfg.decode.max_new_tokens)
    if not texts:
        raise EngineError("no prompt left for vLLM's serving benchmark: " + "; ".join(notes))
    count = cfg.engine_num_prompts or max(len(texts), max(cfg.engine_concurrency))
    work = out / "serving"
    prompts = write_requests(texts, count, work / "requests.json")
    plan = SweepPlan(
        list(cfg.engine_concurrency),
        count,
        cfg.decode.max_new_tokens,
        target.stop_token_ids,
        target.source,
        cfg.warmup,
    )
    spec = None if cfg.engine_url else speculative_config(head_dir, cfg.decode.chain_length)
    baselines = {b: baseline_speculative_config(b, cfg.decode.chain_length) for b in cfg.engine_baselines}
    load_before = os.getloadavg()[0]
    results = run_sweep(
        plan,
        work / "requests.json",
        work,
        python=cfg.engine_python,
        urls={PLAIN: cfg.engine_plain_url, HEAD: cfg.engine_url} if cfg.engine_url else None,
        commands=None if cfg.engine_url else serve_commands(cfg, target, spec, baselines),
        log_dir=out,
        ready_timeout_s=cfg.engine_ready_timeout_s,
    )
    classify = text_classifier(target.tokenizer, classify_ids) if classify_ids else None
    identity = {
        c: {
            name: compare_answers(prompts, by_server[PLAIN], by_server[name], classify)
            for name in by_server
            if name != PLAIN
        }
        for c, by_server in results.items()
    }
    setup = {
        "servers": (
            f"running: plain {cfg.engine_plain_url}, head {cfg.engine_url} (levels interleaved)"
            if cfg.engine_url
            else "started here one after the other (logs: vllm_serve_plain.log, vllm_serve_head.log), "
            f"head: {json.dumps(spec)}, extra flags: {cfg.engine_serve_args or 'none'}"
        ),
        **(
            {
                "vLLM's own speculation beside the head": "; ".join(
                    f"{b}: {json.dumps(c)}" for b, c in baselines.items()
                )
            }
            if baselines
            else {}
        ),
        "requests per level": f"{count}: the {len(texts)} first-turn prompts of the evaluation in order"
        + (", repeated" if count > len(texts) else ""),
        "answers": f"greedy, at most {plan.max_tokens} tokens, stop tokens {plan.stop_token_ids}",
        "warm-up": f"{plan.warmup} x concurrency requests before each run (untimed)",
        "vLLM's result files": f"serving/{{{','.join([*SERVERS, *baselines])}}}-c{{N}}.json (their console "
        "output: .log)",
        "load average (1 min) before / after": f"{load_before:.2f} / {os.getloadavg()[0]:.2f}",
    }
    section = serving_section(results, identity, setup, out, cfg.plots)
    section["sanity"] = notes + section["sanity"]
    return section
