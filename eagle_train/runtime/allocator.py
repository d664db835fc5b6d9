"""The CPU memory allocator's setting for training: large blocks mapped, so freed memory goes back."""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # the mallopt parameter, <malloc.h>
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value


# Training on the CPU against an LM head of fewer elements (vocab x hidden) keeps glibc's default: a small
# target's many short steps pay more in page faults than the memory is worth (stories260K, 300 steps of the
# CPU recipe: 60 / 67 s with the threshold fixed vs 36 / 44 s without; llama-1b-32k: same step times).
MAPPED_FROM_ELEMENTS = 2**24  # e.g. 512 x 32000


def map_large_allocations(device: str, lm_head_elements: int, threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """For CPU training against a large target (`lm_head_elements` >= MAPPED_FROM_ELEMENTS), fix glibc's
    mmap threshold at `threshold` bytes: every larger CPU allocation (a tensor) gets its own mapping,
    returned to the OS when freed.

    By default glibc raises the threshold, up to 32 MB, each time a mapped block is freed; from then on a
    step's activations are carved from the heap, whose pages stay resident behind any live block above
    them, so the resident set grows step after step by fragments no tensor uses. Measured with
    scripts/bench_memory.py (llama-1b-32k, one process): peak RSS 2269 MB with glibc's default, 2118 MB
    with the threshold fixed, same step times. Returns whether it was set: not on an accelerator (the
    host then holds no activations), not for a small target, not off glibc, and not when the user chose a
    threshold through MALLOC_MMAP_THRESHOLD_ (glibc reads it at start-up)."""
    if device != "cpu" or lm_head_elements < MAPPED_FROM_ELEMENTS:
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    done = bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, threshold))
    if done:
        log.debug("glibc mmap threshold fixed at %d bytes", threshold)
    return done
