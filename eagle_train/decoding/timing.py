"""Where a generation's time goes, measured without stopping the accelerator to look.

The decoder and its drafter time every phase the same way, through one `PhaseTimer` per generation:
prefill, drafting and verification, and inside them the target's and the draft head's forwards. On a
CUDA device a phase is two CUDA events recorded on the device's stream: recording does not wait for
the device, so decoding never synchronises to time itself; `read()` synchronises once, when the timings
are read (at the end of a generation), and adds each phase's elapsed time to its `GenerationStats`
field. Elsewhere (the CPU, where the work is done when a call returns) a phase is `time.perf_counter`
around it, added as it ends.

    timer = PhaseTimer(stats, device)
    with timer("time_draft"):                    # a phase as a block
        ...
    start = timer.start(); ...; timer.stop("time_target_forward", start)   # or by hand (hot paths)
    timer.read()                                 # the one synchronisation, before the fields are read
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from eagle_train.decoding.stats import GenerationStats


class PhaseTimer:
    """Accumulates elapsed seconds into the `time_*` fields of a `GenerationStats` (see the module
    docstring). `device`: events on a CUDA device, the host clock otherwise (None: the host clock)."""

    def __init__(self, stats: GenerationStats, device: torch.device | str | None = None):
        self.stats = stats
        device = None if device is None else torch.device(device)
        self.stream = (
            torch.cuda.current_stream(device) if device is not None and device.type == "cuda" else None
        )
        self.device = device
        self.pending: list[tuple[str, Any, Any]] = []  # (field, start event, end event) not yet read

    def start(self) -> Any:
        """A start mark: a recorded CUDA event, or the host clock's reading."""
        if self.stream is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def stop(self, name: str, start: Any) -> None:
        """End the phase begun at `start`: its time goes to the stats field `name` (now, or at `read`)."""
        if self.stream is None:
            setattr(self.stats, name, getattr(self.stats, name) + time.perf_counter() - start)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        self.pending.append((name, start, end))

    def __call__(self, name: str) -> _Phase:
        return _Phase(self, name)

    def read(self) -> GenerationStats:
        """Add every pending phase's time to its field (one synchronisation on CUDA); return the stats."""
        if self.pending:
            torch.cuda.synchronize(self.device)
            for name, start, end in self.pending:
                setattr(self.stats, name, getattr(self.stats, name) + start.elapsed_time(end) / 1e3)
            self.pending.clear()
        return self.stats


class _Phase:
    """`with timer(name):` (a class, not a generator: it runs several times per round)."""

    def __init__(self, timer: PhaseTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.begun = self.timer.start()

    def __exit__(self, *exc) -> None:
        self.timer.stop(self.name, self.begun)


# ---- timing decoders against each other on a shared machine ---------------------------------------------


def pass_orders(count: int, index: int, repeats: int, step: int = 1) -> list[list[int]]:
    """The order of each of `repeats` passes in which `count` decoders answer item `index` (a prompt) in turn:
    pass r starts at decoder (index * repeats + r) * step mod count, so a burst of load on a shared machine
    falls on every decoder and a drift of the load within a pass does not always favour the same ones
    (`step` > 1 spreads the first decoders when there are more decoders than passes)."""
    if count < 1 or repeats < 1:
        raise ValueError(f"pass_orders needs a decoder and a pass, got {count} decoders, {repeats} passes")
    orders = []
    for r in range(repeats):
        shift = (index * repeats + r) * step % count
        orders.append(list(range(shift, count)) + list(range(shift)))
    return orders


def median_pass(passes: list, seconds: Callable[[Any], float] = float) -> Any:
    """The pass of median `seconds` among `passes` (the lower middle one for an even count): one real
    pass, so its time and its statistics belong together."""
    if not passes:
        raise ValueError("median_pass of no passes")
    return sorted(passes, key=seconds)[(len(passes) - 1) // 2]
