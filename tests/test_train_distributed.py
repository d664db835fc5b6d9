"""Multi-process training on the CPU through `accelerate launch` (gloo): DDP and DeepSpeed ZeRO-2.

Tolerance: the same global batch (2 processes x 1 micro-batch vs 1 process x 2 micro-batches) gives the
same per-step losses and gradient norms within rel 1e-6 and the same final weights within atol 1e-6 (only
the order of the float additions in the gradient all-reduce differs). The gradient norm matters: Adam
normalises the gradient's scale and clipping caps it, so a gradient off by 2x leaves the losses nearly
unchanged.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle_train.cli import compose
from eagle_train.config.base import to_schema
from eagle_train.config.train import TrainConfig
from eagle_train.train import run
from tests.test_train_dflash import DFLASH

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ARGS = (
    "+recipe=stories260k_cpu",
    "progress=false",
    "max_steps=4",
    "log_every=1",
    "eval_every=0",
    "save_every=2",
    "max_tokens=512",
    "max_batch_size=4",
    "eval_max_samples=4",
    "optim.warmup_steps=1",
    "data.eval_fraction=0.1",
)


def read_losses(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


EAGLE3 = ("draft.type=eagle3", "draft.vocab_size=256", "loss.ttt_steps=3")
PEAGLE = ("draft.type=peagle", "draft.vocab_size=256", "draft.num_layers=2", "loss.cod.num_depths=4")
HEADS = {"eagle3": EAGLE3, "peagle": PEAGLE, "dflash": DFLASH}
DEEPEST = {"eagle3": "ce_step3", "peagle": "ce_depth4", "dflash": "ce_slot3"}  # the last step's / slot's CE


def launch(
    launcher: list[str], store: Path, out: Path, env: dict | None = None, extra: tuple[str, ...] = ()
) -> list[dict]:
    """`accelerate launch ... train.py` with the shared overrides; returns the per-step metric lines."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **(env or {})}
    args = [*ARGS, *extra, f"features={store}", f"out_dir={out}"]
    done = subprocess.run(
        [*launcher, str(REPO / "train.py"), *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return read_losses(out)


@pytest.fixture(scope="module")
def single(tiny_store, tmp_path_factory) -> Path:
    """The reference: ONE process, grad_accum=2 (same global batch as 2 processes x 1), in this process."""
    out = tmp_path_factory.mktemp("single")
    cfg = compose("train", overrides=[*ARGS, f"features={tiny_store}", f"out_dir={out}", "grad_accum=2"])
    run(to_schema(cfg, TrainConfig))
    return out


def single_run(store: Path, out: Path, head: tuple[str, ...]) -> Path:
    overrides = [*ARGS, *head, f"features={store}", f"out_dir={out}", "grad_accum=2"]
    run(to_schema(compose("train", overrides=overrides), TrainConfig))
    return out


@pytest.fixture(scope="module")
def single_eagle3(tiny_store_aux, tmp_path_factory) -> Path:
    """The same reference for an EAGLE-3 head (training-time test of 3 steps, 256-token draft vocabulary)."""
    return single_run(tiny_store_aux, tmp_path_factory.mktemp("single_eagle3"), EAGLE3)


@pytest.fixture(scope="module")
def single_peagle(tiny_store_aux, tmp_path_factory) -> Path:
    """The same reference for a 2-layer P-EAGLE head (COD over 4 depths): each micro-batch's COD sample
    comes from its own seed, so the process layout does not change it."""
    return single_run(tiny_store_aux, tmp_path_factory.mktemp("single_peagle"), PEAGLE)


@pytest.fixture(scope="module")
def single_dflash(tiny_store_aux, tmp_path_factory) -> Path:
    """The same reference for a DFlash head (blocks of 4, 24 anchors per sequence): each micro-batch's
    anchors come from its own seed, so the process layout does not change them."""
    return single_run(tiny_store_aux, tmp_path_factory.mktemp("single_dflash"), DFLASH)


def two_processes(config: str | None = None) -> list[str]:
    head = [ACCELERATE, "launch", "--num_processes", "2", "--main_process_port", str(free_port())]
    return [*head, "--config_file", config, "--mixed_precision", "no"] if config else [*head, "--multi_gpu"]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def test_two_process_ddp_equals_one_process_with_the_same_global_batch(tiny_store, single, tmp_path):
    ddp = launch(two_processes(), tiny_store, tmp_path / "ddp", env={"ACCELERATE_USE_CPU": "true"})
    reference = read_losses(single)
    assert [m["step"] for m in ddp] == [1, 2, 3, 4]
    for a, b in zip(ddp, reference, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["lr"] == b["lr"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    wa, wb = weights(tmp_path / "ddp"), weights(single)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-6
    at_step2 = load_file(str(tmp_path / "ddp" / "checkpoints" / "step_0000002" / "model.safetensors"))
    assert any(not torch.equal(wa[k], at_step2[k]) for k in wa)  # it trained between the checkpoints


@pytest.mark.parametrize("head", ["eagle1", "eagle3", "peagle", "dflash"])
def test_two_process_deepspeed_zero2_trains_checkpoints_and_averages(request, tmp_path, head):
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    store = request.getfixturevalue("tiny_store" if head == "eagle1" else "tiny_store_aux")
    single = request.getfixturevalue("single" if head == "eagle1" else f"single_{head}")
    ShareMemCommBuilder().load()  # JIT-build DeepSpeed's CPU comm op once, outside the 2 ranks (cached)
    config = str(REPO / "conf" / "accelerate" / "deepspeed_zero2.yaml")
    ds = launch(two_processes(config), store, tmp_path / "ds", extra=HEADS.get(head, ()))
    # gradients really average over both ranks: ZeRO-2 follows the 1-process run step for step
    for a, b in zip(ds, read_losses(single), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    state = tmp_path / "ds" / "checkpoints" / "step_0000004" / "training_state"
    assert sorted(p.name for p in (state / "pytorch_model").glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    wa, wb = weights(tmp_path / "ds"), weights(single)
    assert max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa) < 1e-5


@pytest.mark.parametrize("head", ["eagle3", "peagle", "dflash"])
def test_two_process_ddp_equals_one_process_for_an_eagle3_head(request, tiny_store_aux, tmp_path, head):
    """The training-time test runs the DDP-wrapped head once per step and its LM head outside the wrapper
    (P-EAGLE: its placeholders too; DFlash: the target's LM head over the blocks' slots, in chunks): the
    gradients still average over both ranks exactly as one process accumulates them, and the summed
    per-slot / per-depth figures reduce to the same values."""
    single = request.getfixturevalue(f"single_{head}")
    env = {"ACCELERATE_USE_CPU": "true"}
    ddp = launch(two_processes(), tiny_store_aux, tmp_path / "ddp", env=env, extra=HEADS[head])
    reference = read_losses(single)
    assert [m["step"] for m in ddp] == [1, 2, 3, 4]
    for a, b in zip(ddp, reference, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a[DEEPEST[head]] == pytest.approx(
            b[DEEPEST[head]], rel=1e-6
        )
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
        if head == "dflash":  # the same blocks on both layouts: their count, acceptance and slot accuracy
            assert a["blocks"] == b["blocks"] and a["accept_len"] == pytest.approx(b["accept_len"], rel=1e-6)
            assert a["acc_slot1"] == pytest.approx(b["acc_slot1"], rel=1e-6)
    wa, wb = weights(tmp_path / "ddp"), weights(single)
    if "t2d" in wb:  # a reduced draft vocabulary's maps: fixed, never trained
        assert torch.equal(wa["t2d"], wb["t2d"]) and torch.equal(wa["d2t"], wb["d2t"])
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa if wa[k].is_floating_point()) < 1e-6
