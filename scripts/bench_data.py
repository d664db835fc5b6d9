"""Data pipeline throughput: loading and rendering ShareGPT files with each kind of template, side by side.

    python scripts/bench_data.py [--repeats 3]

Prints a table and writes bench_results/data.json: conversations/s and tokens/s (medians over repeats)
for loading + normalising, and for tokenising with the `plain` and `vicuna_v1.1` fallbacks and with two
Hugging Face templates, a minimal ChatML one and the published Llama-3.1-8B-Instruct one
(tests/data/templates; each conversation is rendered twice to locate its replies), plus `num_proc=2`
against 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from datasets.utils.logging import disable_progress_bar

from eagle_train.config.base import data_path
from eagle_train.config.target import TargetConfig
from eagle_train.data.render import ChatRenderer, tokenize_conversations
from eagle_train.data.sharegpt import load_sharegpt
from eagle_train.modeling.target import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
SHAREGPT = data_path("sharegpt")
FILES = {
    "alpaca": SHAREGPT / "alpaca_cleaned_1000_as_sharegpt.json",
    "fastchat": SHAREGPT / "fastchat_dummy_conversation.json",
}
LLAMA3_1 = REPO_ROOT / "tests" / "data" / "templates" / "llama3_1_8b_instruct.jinja"
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median wall time of `fn()` over `repeats` runs, and its last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def renderers() -> dict[str, ChatRenderer]:
    cfg = TargetConfig(path=str(data_path("models/stories260K")))
    tok = load_tokenizer(cfg)
    hf_tok = load_tokenizer(cfg)
    hf_tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf_tok.chat_template = CHATML
    llama_tok = load_tokenizer(cfg)
    llama_tok.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"],
        }
    )
    llama_tok.chat_template = LLAMA3_1.read_text(encoding="utf-8")
    return {
        "plain": ChatRenderer(tok, TargetConfig(chat_template="plain"), 4096),
        "vicuna_v1.1": ChatRenderer(tok, TargetConfig(chat_template="vicuna_v1.1"), 4096),
        "hf_chatml": ChatRenderer(hf_tok, TargetConfig(), 4096),
        "hf_llama3.1": ChatRenderer(llama_tok, TargetConfig(), 4096),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    disable_progress_bar()
    rows = []
    for data_name, path in FILES.items():
        seconds, (ds, _) = timed(lambda p=path: load_sharegpt(p), args.repeats)
        rows.append(
            {
                "file": data_name,
                "step": "load",
                "conversations_per_s": len(ds) / seconds,
                "tokens_per_s": None,
            }
        )
        for name, renderer in renderers().items():
            for num_proc in (None, 2):
                seconds, (out, _) = timed(
                    lambda d=ds, r=renderer, n=num_proc: tokenize_conversations(d, r, n), args.repeats
                )
                rows.append(
                    {
                        "file": data_name,
                        "step": f"tokenize {name} num_proc={num_proc or 1}",
                        "conversations_per_s": len(ds) / seconds,
                        "tokens_per_s": sum(out["num_tokens"]) / seconds,
                    }
                )
    print(f"{'file':10} {'step':38} {'conv/s':>10} {'tokens/s':>12}")
    for r in rows:
        tokens = f"{r['tokens_per_s']:12.0f}" if r["tokens_per_s"] else f"{'':12}"
        print(f"{r['file']:10} {r['step']:38} {r['conversations_per_s']:10.0f} {tokens}")
    out = REPO_ROOT / "bench_results" / "data.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"repeats": args.repeats, "rows": rows}, indent=2))
    print(f"wrote {Path(out).relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
