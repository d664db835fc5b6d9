"""What a speculative round costs on the device at hand: measured cost curves, cached in the run directory.

A round drafts a tree, verifies it with one target forward and catches the draft up on the accepted
tokens. Each part is timed here with the real target and the real draft head (decoding.drafter), at the
context length the decoder will run at, so the shape chooser (autotune.shapes) predicts a round's time
from measurements, not from a model of the hardware:

    verify_s[n - 1]         one target forward over n tree tokens + the argmax of its logits, n = 1..max_nodes
                            (n = 1 is a plain decoding step: the ar baseline's cost per token)
    expand_s[d - 1][k - 1]  one EAGLE-2 expansion of depth d and top_k k (d draft steps of width k, the
                            top-k / sort per depth and the rerank), d = 1..max_depth, k = 1..max_k
    step_s[w - 1]           one draft step of width w + its top-k (static trees: chain, EAGLE-1; P-EAGLE's
                            row lookup + top-k stands for its whole static draft, one top-k for all depths)
    catch_up_s[m - 1]       the draft's catch-up over m accepted tokens (once per round), m = 1..max_depth + 2
                            (P-EAGLE: over m inputs, m = 1..2 max_depth + 2: its catch-up carries the round's
                            placeholders, so a round's draft forward is catch_up(accepted + placeholders),
                            and its draft steps are row lookups, timed as they are)

Each figure is the fastest of `repeats` timings taken round-robin over the grid (on a shared machine
interference only ever adds time, so the fastest is the cost of the work itself; a burst of load hits
every point alike). The curves depend on the target and head architectures, the
device, the thread count, the dtype and the context length, not on the weights: `cost_key` names that
tuple, and `cached_costs` keeps one JSON file per key under the run directory
(eagle_train.runtime.atomic_files: written atomically), so a rerun or another benchmark of the same run measures nothing again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eagle_train.decoding.decoder import head_reads, parallel_slots
from eagle_train.decoding.drafter import Drafter
from eagle_train.decoding.expand import expand_dynamic
from eagle_train.decoding.stats import GenerationStats
from eagle_train.runtime.atomic_files import FileFormatError, atomic_write_json, read_json

COSTS_VERSION = 1
STATIC_WIDTH = 16  # the widest static-tree depth timed (mc_sim_7b_63's widest has 8 nodes)


@dataclass
class CostCurves:
    """Measured seconds of each part of a round (see the module docstring); `key` says what they hold for."""

    key: dict[str, Any]
    verify_s: list[float]
    expand_s: list[list[float]]
    step_s: list[float]
    catch_up_s: list[float]
    seconds: float = 0.0  # how long the measurement took
    parallel: bool = False  # P-EAGLE: catch-ups carry the round's placeholders (`catch_up`)

    @property
    def max_nodes(self) -> int:
        return len(self.verify_s)

    def verify(self, nodes: int) -> float:
        return self.verify_s[min(nodes, self.max_nodes) - 1]

    def catch_up(self, tokens: float, placeholders: int = 0) -> float:
        """Catch-up seconds over `tokens` accepted tokens (interpolated: tau is fractional); P-EAGLE curves
        add the round's `placeholders` (its tree depth - 1) to the inputs of that one forward."""
        x = tokens + (placeholders if self.parallel else 0)
        x = min(max(x, 1.0), float(len(self.catch_up_s)))
        lo = int(x)
        hi = min(lo + 1, len(self.catch_up_s))
        return self.catch_up_s[lo - 1] + (x - lo) * (self.catch_up_s[hi - 1] - self.catch_up_s[lo - 1])

    def expand(self, depth: int, top_k: int) -> float:
        return self.expand_s[depth - 1][top_k - 1]

    def static_draft(self, level_widths: list[int]) -> float:
        """A static tree's drafting: one step per depth but the last (widths = nodes per depth). P-EAGLE
        curves: one top-k over every depth's row (`expand.expand_parallel`), about one step's cost."""
        if self.parallel:
            return self.step_s[0]
        widths = [min(w, len(self.step_s)) for w in level_widths[:-1]]
        return sum(self.step_s[w - 1] for w in widths)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def device_name(device: torch.device) -> str:
    """The device as a cost-cache key: the GPU's name, or the CPU's model and core count."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{platform.processor() or platform.machine()}:{os.cpu_count()} cores"


def _architecture(config: Any) -> str:
    """A short hash of a model config's shape fields (the weights do not change a forward's time)."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    fields = {k: v for k, v in data.items() if isinstance(v, (int, float, str, bool, type(None)))}
    fields.pop("_name_or_path", None)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def cost_key(
    target, head, context: int, max_nodes: int, max_depth: int, max_k: int, repeats: int
) -> dict[str, Any]:
    """What cost curves hold for: (target, device, threads, dtype) and the head's shape, the context
    length and the grid. The one home of that rule (the cache file name is a hash of it). A target whose
    decoder runs compiled (target.compile_decode) is another key, and each inductor wrapper it runs another
    (`Target.compile_options`; absent uncompiled: older files stay valid), and its frozen graphs another
    (target.compile_frozen)."""
    compiled = bool(getattr(getattr(target, "cfg", None), "compile_decode", False))
    frozen = compiled and bool(getattr(target.cfg, "compile_frozen", False))
    parallel = getattr(head, "drafts_in_catch_up", False)  # drafts in its catch-up: other curves
    return {
        **({"compile_decode": True, **target.compile_options} if compiled else {}),
        **({"compile_frozen": True} if frozen else {}),
        **({"head_kind": head.kind} if parallel else {}),
        "version": COSTS_VERSION,
        "target": _architecture(target.config),
        "head": _architecture(head.config),
        "device": device_name(target.device),
        "threads": torch.get_num_threads() if target.device.type == "cpu" else None,
        "dtype": str(target.dtype).removeprefix("torch."),
        "context": context,
        "grid": [max_nodes, max_depth, max_k, repeats],
    }


def cache_path(cache_dir: str | Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"costs-{digest}.json"


def cached_costs(
    cache_dir: str | Path, key: dict[str, Any], measure: Callable[[], CostCurves]
) -> tuple[CostCurves, bool]:
    """(the cost curves of `key`, whether they were reused): from `cache_dir` when an earlier run measured
    them, else `measure()` (then written there atomically). A file whose key differs (a hash collision,
    an edit) is measured again and replaced."""
    path = cache_path(cache_dir, key)
    if path.is_file():
        try:
            data = read_json(path, "cost curves")
            if isinstance(data, dict) and data.get("key") == key:
                return CostCurves(**data), True
        except (FileFormatError, TypeError):
            pass
    costs = measure()
    atomic_write_json(path, costs.to_dict())
    return costs, False


class _Timer:
    """Round-robin timings: `time(name, fn)` per call, the fastest of each at the end."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.samples: dict[Any, list[float]] = {}

    def time(self, name: Any, fn: Callable[[], Any]) -> None:
        if self.sync:
            self.sync()
        start = time.perf_counter()
        fn()
        if self.sync:
            self.sync()
        self.samples.setdefault(name, []).append(time.perf_counter() - start)

    def best(self, name: Any) -> float:
        return min(self.samples[name])


def measure_costs(
    target, head, context: int, max_nodes: int = 80, max_depth: int = 8, max_k: int = 10, repeats: int = 5
) -> CostCurves:
    """Time every part of a round at `context` committed tokens (see the module docstring). The target
    and head are the real ones; the context is the target's own features of a fixed token pattern."""
    start = time.perf_counter()
    device = target.device
    key = cost_key(target, head, context, max_nodes, max_depth, max_k, repeats)
    max_width = max(max_k, STATIC_WIDTH)
    aux, vocab_map = head_reads(head, device)  # verification forwards return the features the head reads
    with torch.inference_mode():
        cache = target.new_cache(context + max_nodes)
        ids = torch.arange(context, device=device) % 97 + 3  # any tokens: the time does not depend on them
        causal = torch.ones(context, context, dtype=torch.bool, device=device).tril()
        _, features = target.decode(
            ids[None], torch.arange(context, device=device)[None], causal[None, None], cache, aux, True
        )
        cache.advance(context)
        mask = torch.ones(1, 1, max_nodes, context + max_nodes, dtype=torch.bool, device=device)
        positions = torch.arange(context, context + max_nodes, device=device)[None]
        tokens = (torch.arange(max_nodes, device=device) % 97 + 3)[None]

        def verify(n: int) -> None:
            logits, _ = target.decode(
                tokens[:, :n], positions[:, :n], mask[:, :, :n, : context + n], cache, aux
            )
            logits[0].argmax(dim=-1).tolist()

        parallel = parallel_slots(head, max_depth + 1)
        drafter = Drafter(
            head, context, max(max_depth * max_k, max_nodes), GenerationStats(), parallel=parallel
        )
        follow = torch.cat([ids[1:], ids[:1]])  # the pairs (f_j, t_{j+1}) of the context
        root_logp = drafter.catch_up(follow, features[0])
        catch_ups = max_depth + 2 + parallel  # P-EAGLE: accepted tokens + placeholders in one forward
        committed = drafter.committed - catch_ups
        timer = _Timer(device)
        for _ in range(repeats + 1):  # the first pass warms up and is dropped
            for n in range(1, max_nodes + 1):
                timer.time(("verify", n), lambda n=n: verify(n))
            for d in range(1, max_depth + 1):
                for k in range(1, max_k + 1):
                    drafter.drop_tree()
                    total = min(max_nodes, k + d * k * k + 1)
                    timer.time(
                        ("expand", d, k),
                        lambda d=d, k=k, t=total, lp=root_logp: expand_dynamic(
                            0, lp, drafter, d, k, t, vocab_map
                        ),
                    )
            for w in range(1, max_width + 1):
                drafter.drop_tree()
                timer.time(("step", w), lambda w=w: _static_step(drafter, w))
            drafter.parallel = 0  # the catch-up curve: over its inputs alone
            for m in range(1, catch_ups + 1):
                drafter.rewind(committed)
                timer.time(("catch_up", m), lambda m=m: drafter.catch_up(follow[-m:], features[0, -m:]))
            drafter.parallel = parallel
            drafter.rewind(committed)
            root_logp = drafter.catch_up(follow[-catch_ups:], features[0, -catch_ups:])
        for name in list(timer.samples):
            timer.samples[name] = timer.samples[name][1:]
    expand = [[timer.best(("expand", d, k)) for d in range(1, max_depth + 1)] for k in range(1, max_k + 1)]
    return CostCurves(
        key=key,
        verify_s=monotone([timer.best(("verify", n)) for n in range(1, max_nodes + 1)]),
        expand_s=[list(row) for row in zip(*(monotone(by_depth) for by_depth in expand), strict=True)],
        step_s=monotone([timer.best(("step", w)) for w in range(1, max_width + 1)]),
        catch_up_s=monotone([timer.best(("catch_up", m)) for m in range(1, catch_ups + 1)]),
        seconds=time.perf_counter() - start,
        parallel=bool(parallel),
    )


def monotone(seconds: list[float]) -> list[float]:
    """A cost curve made non-decreasing from the right (cost(n) = the least cost measured at n or more):
    more work never costs less, so a higher figure below a lower one is interference, not cost."""
    out = list(seconds)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def _static_step(drafter: Drafter, width: int) -> None:
    """One static-tree draft step of `width` inputs below the root, with the top-k that follows it."""
    device = drafter.device
    tokens = torch.zeros(width, dtype=torch.long, device=device)
    parents = torch.full((width,), -1, dtype=torch.long, device=device)
    log_probs = drafter(tokens, parents, torch.eye(width, dtype=torch.bool, device=device), 1)
    torch.topk(log_probs, 1, dim=-1)


def choose_threads(
    target, context: int, nodes: int, candidates: list[int], repeats: int = 7
) -> dict[str, Any]:
    """The CPU thread count under which the target's forwards run fastest, measured round-robin over
    `candidates` at 1 and `nodes` tokens (the baseline's step and a tree's verification; the fastest of
    `repeats` each); torch is left set to the winner. Returns {"threads": best, "seconds": {threads:
    [1-token, n-token seconds]}}."""
    timings: dict[int, list[list[float]]] = {t: [[], []] for t in candidates}
    with torch.inference_mode():
        cache = target.new_cache(context + nodes)
        cache.advance(context)
        device = target.device
        mask = torch.ones(1, 1, nodes, context + nodes, dtype=torch.bool, device=device)
        ids = torch.full((1, nodes), 3, dtype=torch.long, device=device)
        positions = torch.arange(context, context + nodes, device=device)[None]
        for _ in range(repeats + 1):
            for threads in candidates:
                torch.set_num_threads(threads)
                for i, n in enumerate((1, nodes)):
                    start = time.perf_counter()
                    target.decode(ids[:, :n], positions[:, :n], mask[:, :, :n, : context + n], cache)
                    timings[threads][i].append(time.perf_counter() - start)
    seconds = {t: [min(s[1:]) for s in v] for t, v in timings.items()}
    best = min(candidates, key=lambda t: sum(seconds[t]))
    torch.set_num_threads(best)
    return {"threads": best, "seconds": seconds}
