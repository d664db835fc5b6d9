"""eagle_train.runtime.allocator: with glibc's mmap threshold fixed, freed tensors leave the resident set."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")

# Frees one 16 MB tensor (glibc then raises its mmap threshold past 4 MB), then holds 64 touched 4 MB
# tensors, each followed by a small live tensor, frees the large ones and reports how much of their
# 256 MB stays resident.
CHILD = r"""
import json, sys
from eagle_train.runtime.allocator import map_large_allocations
done = map_large_allocations("cpu", 2**30) if sys.argv[1] == "set" else None
import torch

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

del_me = torch.ones(4 * 2**20)
del del_me
large, small = [], []
for _ in range(64):
    large.append(torch.ones(2**20))
    small.append(torch.ones(16))
before = rss_mb()
large.clear()
print(json.dumps({"set": done, "kept_mb": rss_mb() - (before - 256)}))
"""


def run_child(mode: str, **env) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_tensors_leave_the_resident_set_only_with_the_threshold_fixed():
    fixed, default = run_child("set"), run_child("default")
    assert fixed["set"] is True
    assert fixed["kept_mb"] < 32, fixed
    assert default["kept_mb"] > 128, default  # the control: glibc's own behaviour keeps them


def test_a_threshold_the_user_chose_is_left_alone():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    assert run_child("set", MALLOC_MMAP_THRESHOLD_="262144", **env)["set"] is False


def test_small_targets_and_accelerators_keep_the_default():
    from eagle_train.runtime.allocator import MAPPED_FROM_ELEMENTS, map_large_allocations

    assert map_large_allocations("cpu", MAPPED_FROM_ELEMENTS - 1) is False  # stories260K: 512 x 64
    assert map_large_allocations("cuda", 2**30) is False
