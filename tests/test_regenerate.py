"""Regeneration of replies by the real stories260K target: resume, batching, limits, turns, sampling."""

from __future__ import annotations

import json

import pytest

import eagle_train.regenerate as regen
from eagle_train.cli import compose
from eagle_train.config.base import to_schema
from eagle_train.config.data import DataConfig
from eagle_train.config.regenerate import RegenerateConfig
from eagle_train.data.render import ChatRenderer
from tests.conftest import DATA


def write_prompts(path, n: int = 50, turns: int = 1) -> list[str]:
    """The first `n` TinyStories evaluation prompts as a prompt-only ShareGPT JSONL; returns the ids."""
    lines = (DATA / "tinystories" / "tinystories_prompts.jsonl").read_text().splitlines()[:n]
    records = []
    for line in lines:
        r = json.loads(line)
        conv = [{"from": "human", "value": r["prompt"]}]
        if turns == 2:
            conv += [
                {"from": "gpt", "value": "(original reply, replaced)"},
                {"from": "human", "value": "Then the sun came out."},
            ]
        records.append({"id": f"story_{r['id']}", "conversations": conv})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return [r["id"] for r in records]


def make_cfg(target_cfg, prompts, out, **kw) -> RegenerateConfig:
    data = DataConfig(name="prompts", path=str(prompts), max_len=kw.pop("data_max_len", None))
    defaults = {"batch_size": 8, "max_new_tokens": 24, "progress": False}
    return RegenerateConfig(target=target_cfg, data=data, out=str(out), **{**defaults, **kw})


def test_shipped_config_composes():
    cfg = to_schema(compose("regenerate", overrides=["turns=all", "temperature=0.7"]), RegenerateConfig)
    prompts = to_schema(
        compose("regenerate", overrides=["data=sharegpt_prompts", "data.limit=5", "data.max_len=300"]),
        RegenerateConfig,
    )
    assert (
        cfg.target.name == "stories260k"
        and cfg.turns == "all"
        and cfg.out == "outputs/regenerated/stories260k_tinystories.jsonl"
    )
    assert prompts.data.name == "sharegpt_prompts" and prompts.data.limit == 5 and prompts.data.max_len == 300


def test_interrupted_and_resumed_equals_uninterrupted(target_cfg, tmp_path, monkeypatch):
    ids = write_prompts(tmp_path / "prompts.jsonl", 50)
    full = regen.run(make_cfg(target_cfg, tmp_path / "prompts.jsonl", tmp_path / "a.jsonl"))
    assert full["records"] == 50 and full["too_long"] == 0
    reference = (tmp_path / "a.jsonl").read_text()
    assert [json.loads(line)["id"] for line in reference.splitlines()] == ids  # input order

    real, calls = regen.generate_batch, []

    def crash_on_fourth_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt  # the user stops the run
        return real(*args, **kwargs)

    monkeypatch.setattr(regen, "generate_batch", crash_on_fourth_batch)
    with pytest.raises(KeyboardInterrupt):
        regen.run(make_cfg(target_cfg, tmp_path / "prompts.jsonl", tmp_path / "b.jsonl"))
    part = tmp_path / "b.jsonl.part0"
    assert len(part.read_text().splitlines()) == 24 and not (tmp_path / "b.jsonl").exists()
    with part.open("a") as f:
        f.write('{"id": "story_99", "conversations": [{"from": "hu')  # a write torn by the crash
    monkeypatch.setattr(regen, "generate_batch", real)
    resumed = regen.run(make_cfg(target_cfg, tmp_path / "prompts.jsonl", tmp_path / "b.jsonl"))
    assert resumed["already_done"] == 24 and resumed["written"] == 26
    assert (tmp_path / "b.jsonl").read_text() == reference
    assert not list(tmp_path.glob("b.jsonl.part*"))
    again = regen.run(
        make_cfg(target_cfg, tmp_path / "prompts.jsonl", tmp_path / "b.jsonl")
    )  # nothing left to do
    assert again["written"] == 0 and (tmp_path / "b.jsonl").read_text() == reference
    # the run that wrote the replies keeps its figures in the stats after a run that had nothing to do
    runs = json.loads((tmp_path / "b.jsonl.stats.json").read_text())["runs"]
    assert [(r["written"], r["tokens"]) for r in runs] == [(26, resumed["tokens"])] and resumed["tokens"] > 0


def test_batched_greedy_equals_one_at_a_time(target, tmp_path):
    write_prompts(tmp_path / "p.jsonl", 8)
    renderer = ChatRenderer(target.tokenizer, target.cfg)
    prompts = [
        renderer.render_prompt([{"role": "user", "content": json.loads(line)["conversations"][0]["value"]}])
        for line in (tmp_path / "p.jsonl").read_text().splitlines()
    ]
    assert len({len(p) for p in prompts}) > 3  # different lengths: real left padding
    batched = regen.generate_batch(target, prompts, 40)
    single = [regen.generate_batch(target, [p], 40)[0] for p in prompts]
    assert batched == single


def test_too_long_prompts_are_skipped_and_counted(target, target_cfg, tmp_path):
    ids = write_prompts(tmp_path / "p.jsonl", 12)
    renderer = ChatRenderer(target.tokenizer, target.cfg)
    lengths = {
        i: len(
            renderer.render_prompt(
                [{"role": "user", "content": json.loads(line)["conversations"][0]["value"]}]
            )
        )
        for i, line in zip(ids, (tmp_path / "p.jsonl").read_text().splitlines(), strict=True)
    }
    limit = sorted(lengths.values())[6] + 8  # room for 8 new tokens after the 7 shortest prompts (ties: more)
    stats = regen.run(
        make_cfg(target_cfg, tmp_path / "p.jsonl", tmp_path / "o.jsonl", max_new_tokens=8, data_max_len=limit)
    )
    fits = [i for i in ids if lengths[i] + 8 <= limit]
    assert stats["too_long"] == 12 - len(fits) > 0
    assert [json.loads(line)["id"] for line in (tmp_path / "o.jsonl").read_text().splitlines()] == fits


def test_every_turn_with_own_replies_in_context(target, target_cfg, tmp_path):
    write_prompts(tmp_path / "p.jsonl", 3, turns=2)
    regen.run(
        make_cfg(target_cfg, tmp_path / "p.jsonl", tmp_path / "o.jsonl", turns="all", max_new_tokens=12)
    )
    record = json.loads((tmp_path / "o.jsonl").read_text().splitlines()[0])
    roles = [t["from"] for t in record["conversations"]]
    assert roles == ["human", "gpt", "human", "gpt"] and len(record["finish_reasons"]) == 2
    first_reply = record["conversations"][1]["value"]
    assert first_reply != "(original reply, replaced)"
    messages = [
        {"role": "user", "content": record["conversations"][0]["value"]},
        {"role": "assistant", "content": first_reply},
        {"role": "user", "content": "Then the sun came out."},
    ]
    prompt = ChatRenderer(target.tokenizer, target.cfg).render_prompt(messages)
    reply, _ = regen.generate_batch(target, [prompt], 12)[0]
    assert record["conversations"][3]["value"] == target.tokenizer.decode(reply, skip_special_tokens=True)


def test_sampling_is_seeded(target_cfg, tmp_path):
    write_prompts(tmp_path / "p.jsonl", 4)
    outs = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        regen.run(
            make_cfg(
                target_cfg,
                tmp_path / "p.jsonl",
                tmp_path / f"{name}.jsonl",
                temperature=1.0,
                top_p=0.9,
                seed=seed,
            )
        )
        outs.append((tmp_path / f"{name}.jsonl").read_text())
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_repeated_ids_lose_no_conversation(target_cfg, tmp_path):
    """Ids `x, x, x_dup1` become `x, x_dup1, x_dup1_dup1`, never a second `x_dup1` (which the resumable
    output would take for done): 3 prompts in, 3 replies out."""
    lines = [
        {"id": i, "conversations": [{"from": "human", "value": f"Once upon a time {i}"}]}
        for i in ("x", "x", "x_dup1")
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in lines))
    stats = regen.run(make_cfg(target_cfg, prompts, tmp_path / "out.jsonl", max_new_tokens=4))
    ids = [json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert stats["records"] == 3 and ids == ["x", "x_dup1", "x_dup1_dup1"]


def test_bad_lines_and_config(target_cfg, tmp_path):
    write_prompts(tmp_path / "p.jsonl", 2)
    record = '{"id": "x", "conversations": [], "finish_reasons": []}'
    (tmp_path / "o.jsonl").write_text(f"{record}\nnot json\n{record}\n")
    with pytest.raises(ValueError, match=r"o.jsonl: line 2: not JSON"):
        regen.run(make_cfg(target_cfg, tmp_path / "p.jsonl", tmp_path / "o.jsonl"))
    with pytest.raises(ValueError, match="turns must be one of"):
        make_cfg(target_cfg, tmp_path / "p.jsonl", tmp_path / "o.jsonl", turns="last")
    with pytest.raises(ValueError, match="set out="):
        regen.run(make_cfg(target_cfg, tmp_path / "p.jsonl", ""))


def test_an_out_that_is_not_this_commands_output_is_refused_and_kept(target_cfg, tmp_path):
    """out = the input (a one-line JSON array, the shape of the shared prompts file), another
    ShareGPT file, or this command's output made with other settings: refused, the file untouched."""
    write_prompts(tmp_path / "p.jsonl", 6)
    records = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(records))  # one line, no newline at the end
    before = prompts.read_bytes()
    with pytest.raises(regen.OutputError, match="is the input data file"):
        regen.run(make_cfg(target_cfg, prompts, prompts))
    copy = tmp_path / "copy.json"
    copy.write_bytes(before)
    with pytest.raises(regen.OutputError, match=r"copy.json: the last line has no newline"):
        regen.run(make_cfg(target_cfg, prompts, copy))
    dataset = tmp_path / "dataset.jsonl"
    dataset.write_text((tmp_path / "p.jsonl").read_text())
    with pytest.raises(
        regen.OutputError, match=r"dataset.jsonl: line 1: not a record written by eagle_train"
    ):
        regen.run(make_cfg(target_cfg, prompts, dataset))
    assert prompts.read_bytes() == before and copy.read_bytes() == before
    assert dataset.read_text() == (tmp_path / "p.jsonl").read_text()

    out = tmp_path / "o.jsonl"
    regen.run(make_cfg(target_cfg, prompts, out, max_new_tokens=8))
    first = out.read_text()
    with pytest.raises(regen.OutputError, match=r"other settings: max_new_tokens: expected 12, found 8"):
        regen.run(make_cfg(target_cfg, prompts, out, max_new_tokens=12))
    assert out.read_text() == first
    again = regen.run(make_cfg(target_cfg, prompts, out, max_new_tokens=12, overwrite=True))
    assert again["already_done"] == 0 and again["records"] == 6 and out.read_text() != first


def test_a_rerun_after_the_targets_weights_changed_in_place_is_refused(target_cfg, tmp_path):
    """A rerun after the target was fine-tuned in place (same path and settings, other decoder weights)
    would add the new model's replies to the old one's: refused, naming the weight file; the output kept."""
    import dataclasses
    import shutil

    from tests.conftest import STORIES260K, decoder_fine_tune

    write_prompts(tmp_path / "p.jsonl", 4)
    model = tmp_path / "model"
    shutil.copytree(STORIES260K, model)
    cfg = make_cfg(
        dataclasses.replace(target_cfg, path=str(model)), tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    )
    regen.run(cfg)
    first = (tmp_path / "o.jsonl").read_text()
    shutil.rmtree(model)
    decoder_fine_tune(model)
    with pytest.raises(regen.OutputError, match=r"other settings: target_weight_files.model.safetensors"):
        regen.run(cfg)
    assert (tmp_path / "o.jsonl").read_text() == first


def test_a_planted_symlink_part_file_is_never_followed(target_cfg, tmp_path):
    """`<out>.part0` planted as a link to another file: refused, that file untouched."""
    write_prompts(tmp_path / "p.jsonl", 3)
    victim = tmp_path / "victim.jsonl"
    victim.write_text('{"id": "v1", "conversations": [], "finish_reasons": []}\n{"id": "v2", "conv')
    before = victim.read_text()
    (tmp_path / "o.jsonl.part0").symlink_to(victim)
    with pytest.raises(regen.OutputError, match="symlink is never followed"):
        regen.run(make_cfg(target_cfg, tmp_path / "p.jsonl", tmp_path / "o.jsonl"))
    assert victim.read_text() == before


@pytest.mark.slow
def test_two_processes_with_accelerate_equal_one(target_cfg, tmp_path):
    """`accelerate launch` with 2 CPU processes: each writes its part, the main one merges in input order."""
    import os
    import subprocess
    import sys

    write_prompts(tmp_path / "p.jsonl", 12)
    args = [
        f"data.path={tmp_path / 'p.jsonl'}",
        "batch_size=4",
        "max_new_tokens=16",
        "num_threads=1",
        "progress=false",
    ]
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "eagle_train.regenerate",
    ]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [*launch, *args, f"out={tmp_path / 'two.jsonl'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads((tmp_path / "two.jsonl.stats.json").read_text())
    assert stats["processes"] == 2 and stats["records"] == 12
    regen.run(
        make_cfg(target_cfg, tmp_path / "p.jsonl", tmp_path / "one.jsonl", batch_size=4, max_new_tokens=16)
    )
    assert (tmp_path / "two.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["p.jsonl", "one.jsonl", "one.jsonl.stats.json", "two.jsonl", "two.jsonl.stats.json"]
    )
