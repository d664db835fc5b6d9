"""Extraction's time to first shard and peak memory against the size of the data file.

    python scripts/bench_extract_memory.py [--sizes 50000 500000] [--tag after] [--src DIR]

Writes synthetic ShareGPT files (a JSON array, the shape of the published ShareGPT dumps: 2-6 turns of
TinyStories sentences per conversation, deterministic) under bench_results/data/, plus one file whose
single reply is 20 MB, then runs `python -m eagle_train.extract` on each as a real process
(stories260K, float32, data.max_len=256, shard_samples=1000, one thread) and stops it as soon as the first
shard is published: seconds from the process start to `shard-00000.safetensors`, and the process's
peak resident memory (wait4's ru_maxrss). `--src DIR` runs the package found in DIR instead (e.g. an
export of another commit: `git archive main | tar -x -C /tmp/old`), so before and after are measured by
the same harness. Prints a table and merges the rows into bench_results/extract_memory.json under
`--tag`. Flat in the file size is the goal: the first shard needs the first 1000 conversations only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "bench_results"
STORIES = REPO_ROOT / "data" / "tinystories" / "tinystories_sharegpt.jsonl"
OVERRIDES = ["dtype=float32", "data.max_len=256", "shard_samples=1000", "progress=false"]


def sentences() -> list[str]:
    """Sentences of the shipped TinyStories conversations."""
    out = []
    for line in STORIES.read_text(encoding="utf-8").splitlines():
        for turn in json.loads(line)["conversations"]:
            out += [s.strip() + "." for s in turn["value"].split(".") if s.strip()]
    return out


def synthetic_file(n: int, pool: list[str]) -> Path:
    """A JSON array of `n` conversations (written once, reused)."""
    path = RESULTS / "data" / f"sharegpt_synthetic_{n}.json"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(n)
    tmp = path.with_suffix(".partial")
    with tmp.open("w", encoding="utf-8") as f:
        f.write("[\n")
        for i in range(n):
            turns = [
                {
                    "from": "human" if k % 2 == 0 else "gpt",
                    "value": " ".join(rng.choices(pool, k=rng.randint(1, 6))),
                }
                for k in range(2 * rng.randint(1, 3))
            ]
            f.write(("" if i == 0 else ",\n") + json.dumps({"id": f"synthetic_{i}", "conversations": turns}))
        f.write("\n]\n")
    tmp.rename(path)
    return path


def huge_message_file(pool: list[str], megabytes: int = 20) -> Path:
    """One conversation whose reply is `megabytes` MB of text (a reply, so that truncation keeps it)."""
    path = RESULTS / "data" / f"sharegpt_one_{megabytes}mb_reply.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        rng, text, size = random.Random(0), [], 0
        while size < megabytes * 2**20:
            text.append(rng.choice(pool))
            size += len(text[-1]) + 1
        turns = [
            {"from": "human", "value": "Tell me a long story."},
            {"from": "gpt", "value": " ".join(text)},
        ]
        path.write_text(json.dumps([{"id": "huge", "conversations": turns}]), encoding="utf-8")
    return path


def first_shard(data: Path, src: Path | None, timeout: float) -> dict:
    """Run extraction on `data` until its first shard is published; seconds and peak RSS (MiB)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if src is not None:
        env.update(PYTHONPATH=str(src), PYTHONDONTWRITEBYTECODE="1")
    with tempfile.TemporaryDirectory(prefix="bench_extract_memory_") as tmp:
        out_dir = Path(tmp) / "store"
        argv = [
            sys.executable,
            "-m",
            "eagle_train.extract",
            f"data.path={data}",
            f"out_dir={out_dir}",
            *OVERRIDES,
        ]
        log = open(Path(tmp) / "stderr.log", "wb")  # a file, not a pipe: a full pipe would stall the run
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=log)
        seconds, usage, error = None, None, ""
        while usage is None and time.perf_counter() - start < timeout:
            if (out_dir / "shard-00000.safetensors").exists():
                seconds = time.perf_counter() - start
                break
            pid, _, finished = os.wait4(proc.pid, os.WNOHANG)  # reaped here, so its rusage is ours
            usage = finished if pid else None
            time.sleep(0.02)
        if usage is None:  # still running: the first shard is there, or the time is up
            proc.send_signal(signal.SIGKILL)
            _, _, usage = os.wait4(proc.pid, 0)
            if seconds is None:
                error = f"no shard after {timeout:.0f} s"
        else:
            error = (Path(tmp) / "stderr.log").read_text(errors="replace")[-2000:]
        proc.returncode = 0  # reaped by wait4 above: keep Popen from waiting again
        log.close()
    return {"seconds_to_first_shard": seconds, "peak_rss_mib": usage.ru_maxrss / 1024, "error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50_000, 500_000])
    parser.add_argument("--tag", default="current", help="the key these rows are saved under")
    parser.add_argument(
        "--src", type=Path, default=None, help="run the eagle_train package in this directory"
    )
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    pool = sentences()
    cases = {f"{n} conversations": synthetic_file(n, pool) for n in args.sizes}
    cases["one 20 MB reply"] = huge_message_file(pool)
    rows = {}
    print(f"{'data':<24}{'file MB':>9}{'s to first shard':>18}{'peak RSS MiB':>14}")
    for name, path in cases.items():
        row = {"file_mb": path.stat().st_size / 2**20, **first_shard(path, args.src, args.timeout)}
        rows[name] = row
        seconds = f"{row['seconds_to_first_shard']:.1f}" if row["seconds_to_first_shard"] else "-"
        print(f"{name:<24}{row['file_mb']:>9.0f}{seconds:>18}{row['peak_rss_mib']:>14.0f}", flush=True)
        if row["error"]:
            print(row["error"])
    out = RESULTS / "extract_memory.json"
    saved = json.loads(out.read_text()) if out.is_file() else {}
    saved[args.tag] = {"overrides": OVERRIDES, "src": str(args.src or REPO_ROOT), "rows": rows}
    out.write_text(json.dumps(saved, indent=2) + "\n")
    print(f"wrote {out.relative_to(REPO_ROOT)} [{args.tag}]")


if __name__ == "__main__":
    main()
