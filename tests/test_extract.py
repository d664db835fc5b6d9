"""`eagle_train.extract.run` in this process on the real stories260K: features, manifest, refusals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eagle_train.cli import compose
from eagle_train.config import to_schema
from eagle_train.config.data import DataConfig
from eagle_train.config.extract import ExtractConfig
from eagle_train.data.batching import bucket_batches, padding_fraction
from eagle_train.data.render import ChatRenderer, tokenize_conversations
from eagle_train.data.sharegpt import DataError, load_conversations
from eagle_train.extract import run
from eagle_train.store.codec import decode
from eagle_train.store.manifest import MANIFEST_NAME, StoreError, StoreMismatchError, target_config_hash
from eagle_train.store.reader import FeatureStore
from eagle_train.store.writer import shard_name
from tests.conftest import DATA, STORIES260K, decoder_fine_tune

ALPACA = str(DATA / "sharegpt" / "alpaca_cleaned_1000_as_sharegpt.json")
FASTCHAT = str(DATA / "sharegpt" / "fastchat_dummy_conversation.json")  # short multi-turn conversations


def extract_cfg(target_cfg, out_dir, path=ALPACA, limit=12, max_len=128, **kw) -> ExtractConfig:
    """Short conversations (max_len 128) keep the target's forwards cheap."""
    data = DataConfig(name="alpaca", path=str(path), limit=limit, max_len=max_len)
    return ExtractConfig(target=target_cfg, data=data, out_dir=str(out_dir), progress=False, **kw)


def test_extract_config_composes_with_overrides(tmp_path):
    cfg = compose(
        "extract", overrides=["data=alpaca", "data.limit=5", f"out_dir={tmp_path}", "dtype=float16"]
    )
    schema = to_schema(cfg, ExtractConfig)
    assert (
        schema.data.name == "alpaca"
        and schema.data.limit == 5
        and schema.dtype == "float16"
        and schema.out_dir == str(tmp_path)
    )
    assert schema.target.chat_template == "plain"
    with pytest.raises(ValueError, match="dtype"):
        ExtractConfig(dtype="int8")


def test_stored_features_are_the_targets(target_cfg, target, tmp_path):
    """Batched, right-padded extraction stores exactly what the target computes on each conversation
    alone: lm_head(hidden) == logits, ids and loss masks as tokenized, nothing of the padding."""
    # a small token budget forces several batches of mixed lengths (so real padding) and 3 shards
    cfg = extract_cfg(
        target_cfg,
        tmp_path,
        path=FASTCHAT,
        limit=8,
        max_len=96,
        dtype="float32",
        max_tokens=256,
        shard_samples=3,
    )
    run(cfg)
    store = FeatureStore(tmp_path)
    messages, _ = load_conversations(cfg.data)
    expected, report = tokenize_conversations(messages, ChatRenderer(target.tokenizer, target_cfg, 96))
    assert store.ids == expected["id"] and len(store.manifest["shards"]) == -(-len(store) // 3) > 1
    assert store.lengths == expected["num_tokens"]
    for shard in store.manifest["shards"]:  # the batches really were padded
        lengths = store.lengths[shard["start"] : shard["stop"]]
        assert padding_fraction(lengths, bucket_batches(lengths, max_tokens=256, max_batch_size=64)) > 0
    for i in range(len(store)):
        sample = store[i]
        assert sample["input_ids"].tolist() == expected[i]["input_ids"]
        assert sample["loss_mask"].tolist() == [bool(m) for m in expected[i]["loss_mask"]]
        logits, hidden = target.features(sample["input_ids"][None])  # [1, L, vocab], [1, L, hidden]
        assert sample["hidden"].shape == (store.lengths[i], target.hidden_size)
        torch.testing.assert_close(sample["hidden"], hidden[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(target.lm_head(sample["hidden"]), logits[0], atol=1e-4, rtol=1e-4)
    manifest = store.manifest
    assert manifest["target"]["hidden_size"] == 64 and manifest["target"]["vocab_size"] == 512
    assert manifest["target"]["config_hash"] == target_config_hash(target.model.config.to_dict())
    assert manifest["template"] == "plain" and manifest["max_len"] == 96 and manifest["dtype"] == "float32"
    counts = manifest["counts"]
    assert counts["conversations"] == len(store) and counts["tokens"] == sum(store.lengths)
    assert counts["skipped"] == report.counts and counts["seen"] == 8
    assert counts["assistant_tokens"] == sum(expected["num_assistant_tokens"])
    assert counts["bytes_per_token"] > 64 * 4  # float32 hidden states dominate


def test_the_presets_training_length_caps_extraction(target_cfg, tmp_path):
    """Without data.max_len, conversations are cut at the preset's train_max_len (the GPU presets: 2048),
    not at the target's full context (stories260K: 512); data.max_len still wins when given."""
    from dataclasses import replace

    capped = replace(target_cfg, train_max_len=40)
    run(extract_cfg(capped, tmp_path / "preset", limit=6, max_len=None, dtype="float32"))
    store = FeatureStore(tmp_path / "preset")
    assert store.manifest["max_len"] == 40 and max(store.lengths) == 40
    run(extract_cfg(capped, tmp_path / "data", limit=6, max_len=24, dtype="float32"))
    assert FeatureStore(tmp_path / "data").manifest["max_len"] == 24


def test_bfloat16_store_keeps_the_argmax(target_cfg, target, tmp_path):
    run(extract_cfg(target_cfg, tmp_path, limit=3))
    store = FeatureStore(tmp_path)
    sample = store[0]
    assert sample["hidden"].dtype == torch.bfloat16
    assert store.manifest["counts"]["bytes_per_token"] < 64 * 2 + 20  # 128 B of hidden + ids, mask, header
    logits, _ = target.features(sample["input_ids"][None])
    agree = (target.lm_head(sample["hidden"].float()).argmax(-1) == logits[0].argmax(-1)).float().mean()
    assert agree > 0.95


def test_fp8_store_is_the_targets_within_e4m3_rounding_at_half_the_bytes(target_cfg, target, tmp_path):
    run(extract_cfg(target_cfg, tmp_path / "fp8", limit=4, dtype="fp8"))
    run(extract_cfg(target_cfg, tmp_path / "bf16", limit=4))
    fp8, bf16 = FeatureStore(tmp_path / "fp8"), FeatureStore(tmp_path / "bf16")
    assert fp8.ids == bf16.ids and fp8.manifest["dtype"] == "fp8"
    for i in range(len(fp8)):
        sample = fp8[i]
        assert sample["hidden"].dtype == torch.float8_e4m3fn
        _, hidden = target.features(sample["input_ids"][None])
        back = decode(sample["hidden"], sample["hidden_scale"], torch.float32)
        scale = sample["hidden_scale"]  # [L, 1]
        assert bool(
            ((back - hidden[0]).abs() <= torch.maximum(hidden[0].abs() / 16, scale * 2**-10) * 1.001).all()
        )
    # d = 64: 64 + 4 bytes of features + 3 of id and mask against 128 + 3
    ratio = fp8.manifest["counts"]["bytes_per_token"] / bf16.manifest["counts"]["bytes_per_token"]
    assert 0.5 < ratio < 0.56


def test_fp8_on_a_torch_without_float8_is_refused_before_anything_is_written(
    target_cfg, tmp_path, monkeypatch
):
    import eagle_train.store.codec as codec

    monkeypatch.setattr(codec, "float8_dtype", lambda: None)
    with pytest.raises(RuntimeError, match=r"dtype=fp8 needs torch.float8_e4m3fn, which torch .* lacks"):
        run(extract_cfg(target_cfg, tmp_path / "store", limit=3, dtype="fp8"))
    assert not (tmp_path / "store").exists()


def test_device_map_auto_extracts_the_same_store(target_cfg, tmp_path):
    """target.device_map=auto (accelerate spreads one target over the visible devices; here the CPU) gives
    the store of the default load, bit for bit."""
    run(extract_cfg(target_cfg, tmp_path / "plain", limit=4, dtype="float32"))
    mapped = replace(target_cfg, device_map="auto")
    run(extract_cfg(mapped, tmp_path / "auto", limit=4, dtype="float32"))
    plain, auto = FeatureStore(tmp_path / "plain"), FeatureStore(tmp_path / "auto")
    assert [s["sha256"] for s in plain.manifest["shards"]] == [s["sha256"] for s in auto.manifest["shards"]]


def test_rerun_with_another_config_is_refused_unless_overwrite(target_cfg, tmp_path):
    run(extract_cfg(target_cfg, tmp_path, limit=3, dtype="float32"))
    before = (tmp_path / MANIFEST_NAME).read_text()
    with pytest.raises(
        StoreMismatchError, match=r"dtype: expected 'bfloat16', found 'float32'.*overwrite=true"
    ):
        run(extract_cfg(target_cfg, tmp_path, limit=3))
    with pytest.raises(StoreMismatchError, match=r"data\.limit: expected 4, found 3"):
        run(extract_cfg(target_cfg, tmp_path, limit=4, dtype="float32"))
    assert (tmp_path / MANIFEST_NAME).read_text() == before  # refused: the store is untouched
    run(extract_cfg(target_cfg, tmp_path, limit=3, overwrite=True))
    assert FeatureStore(tmp_path).manifest["dtype"] == "bfloat16"
    # batch sizes are not part of the contents: a rerun with other ones keeps the store
    run(extract_cfg(target_cfg, tmp_path, limit=3, max_batch_size=1))
    assert len(FeatureStore(tmp_path)) == 3


def write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "data file not found"),
        ("directory", "is a directory"),
        ("empty", "file is empty"),
        ("malformed", "bad.json"),
        ("schema", "wrong schema"),
        ("prompts_only", "eagle_train.regenerate"),
    ],
)
def test_bad_input_fails_before_writing(target_cfg, tmp_path, case, message):
    good = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    paths = {
        "missing": tmp_path / "nope.json",
        "directory": tmp_path,
        "empty": write(tmp_path / "empty.json", ""),
        "malformed": write(tmp_path / "bad.json", json.dumps([good])[:-1] + ', {"id": "b", "conv'),
        "schema": write(
            tmp_path / "schema.jsonl", json.dumps(good) + "\n" + json.dumps({"id": "x", "turns": 3})
        ),
        "prompts_only": write(
            tmp_path / "p.json", json.dumps([{"id": "p", "conversations": good["conversations"][:1]}])
        ),
    }
    out_dir = tmp_path / "store"
    with pytest.raises(DataError, match=message):
        run(extract_cfg(target_cfg, out_dir, path=paths[case]))
    assert not out_dir.exists()


def test_aux_layers_are_extracted_for_eagle3(target_cfg, target, tmp_path):
    """aux=true stores the inputs of target.aux_layers beside the last hidden state, exactly what the
    target computes on each conversation alone; 4 hidden states per token: 4x the EAGLE-1 bytes."""
    plain, aux = tmp_path / "plain", tmp_path / "aux"
    run(extract_cfg(target_cfg, plain, path=FASTCHAT, limit=6, max_len=96, dtype="float32", max_tokens=256))
    run(
        extract_cfg(
            target_cfg, aux, path=FASTCHAT, limit=6, max_len=96, dtype="float32", max_tokens=256, aux=True
        )
    )
    one, four = FeatureStore(plain), FeatureStore(aux, aux=True)
    assert four.aux_layers == target.aux_layers == [1, 2, 4] and one.aux_layers == []
    assert "aux_layers" not in one.manifest  # an EAGLE-1 store is what it always was
    for i in range(len(four)):
        sample = four[i]
        hidden, expected = target.aux_hidden_states(sample["input_ids"][None], None, [1, 2, 4])
        torch.testing.assert_close(sample["aux"], expected[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sample["hidden"], one[i]["hidden"], atol=1e-5, rtol=1e-5)
    per_token = [s.manifest["counts"]["bytes_per_token"] for s in (one, four)]
    assert 3.9 < per_token[1] / per_token[0] < 4.0  # ids, mask and headers are shared
    with pytest.raises(StoreMismatchError, match="aux_layers"):
        run(extract_cfg(target_cfg, plain, path=FASTCHAT, limit=6, max_len=96, dtype="float32", aux=True))


def test_repeated_ids_give_a_store_training_opens(target_cfg, tmp_path):
    """Ids `x, x, x_dup1` are stored as `x, x_dup1, x_dup1_dup1`, never as a second `x_dup1` (a store
    training would refuse as "duplicated or misplaced")."""
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]
    data = write(
        tmp_path / "dups.jsonl",
        "".join(json.dumps({"id": i, "conversations": turns}) + "\n" for i in ("x", "x", "x_dup1")),
    )
    run(extract_cfg(target_cfg, tmp_path / "store", path=data, limit=None, shard_samples=2))
    assert FeatureStore(tmp_path / "store").ids == ["x", "x_dup1", "x_dup1_dup1"]


def test_a_rerun_repairs_a_broken_manifest_and_keeps_the_shards(target_cfg, tmp_path):
    """A truncated manifest.json: training names the file; a rerun of the extraction rewrites it
    and keeps every shard."""
    cfg = extract_cfg(target_cfg, tmp_path, limit=6, dtype="float32", shard_samples=2)
    run(cfg)
    ids = FeatureStore(tmp_path).ids
    kept = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("shard-*.safetensors")}
    (tmp_path / MANIFEST_NAME).write_text((tmp_path / MANIFEST_NAME).read_text()[:100])
    with pytest.raises(StoreError, match=r"manifest.json \(feature store manifest\): not valid JSON"):
        FeatureStore(tmp_path)
    run(cfg)
    assert FeatureStore(tmp_path).ids == ids and len(kept) == 3
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("shard-*.safetensors")} == kept


def rot_in_place(shard: Path, at: int = -64) -> None:
    """Flip one byte of a shard in place, as a failing disk would: same inode, same size, same mtime."""
    before = shard.stat()
    with shard.open("r+b") as f:
        f.seek(at, 2)
        byte = f.read(1)
        f.seek(at, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (shard.stat().st_mtime_ns, shard.stat().st_ino) == (before.st_mtime_ns, before.st_ino)


def test_a_rerun_repairs_a_shard_training_found_rotted(target_cfg, tmp_path):
    """A shard whose bytes rotted in place (mtime kept) is refused by training, which records the damage in
    the shard's sidecar; a rerun re-hashes that shard and extracts it again (the others are kept), to the
    very bytes it had."""
    cfg = extract_cfg(target_cfg, tmp_path, limit=6, dtype="float32", shard_samples=2)
    run(cfg)
    good = (tmp_path / shard_name(1)).read_bytes()
    kept = {k: (tmp_path / shard_name(k)).stat().st_mtime_ns for k in (0, 2)}
    rot_in_place(tmp_path / shard_name(1))
    with pytest.raises(StoreError, match=r"shard-00001.safetensors: its checksum .* rerun the extraction"):
        FeatureStore(tmp_path).verify()  # what training does when it first reads the shard
    assert "damaged" in json.loads((tmp_path / "shard-00001.json").read_text())
    run(cfg)
    assert (tmp_path / shard_name(1)).read_bytes() == good
    assert {k: (tmp_path / shard_name(k)).stat().st_mtime_ns for k in (0, 2)} == kept
    FeatureStore(tmp_path).verify()
    assert "damaged" not in json.loads((tmp_path / "shard-00001.json").read_text())


def test_verify_full_repairs_a_rot_nothing_reported(target_cfg, tmp_path):
    """A shard rotted in place that no reader has seen yet: a plain rerun trusts its unchanged
    size and mtime (a resume never re-reads the store); verify=full re-hashes every shard and repairs it."""
    cfg = extract_cfg(target_cfg, tmp_path, limit=6, dtype="float32", shard_samples=2)
    run(cfg)
    good = (tmp_path / shard_name(2)).read_bytes()
    rot_in_place(tmp_path / shard_name(2))
    run(cfg)
    assert (tmp_path / shard_name(2)).read_bytes() != good  # not re-read: the documented limit
    run(replace(cfg, verify="full"))
    assert (tmp_path / shard_name(2)).read_bytes() == good
    FeatureStore(tmp_path).verify()


def test_a_rerun_after_the_decoder_layers_changed_is_refused(target_cfg, tmp_path):
    """The target's identity is the sha256 of every weight file, not its embedding and LM head alone: a
    resumed extraction after its decoder layers changed in place is refused, naming the file, and never
    mixes the shards of two models."""
    model = decoder_fine_tune(tmp_path / "model")
    shutil.copytree(STORIES260K, tmp_path / "original")
    cfg = extract_cfg(replace(target_cfg, path=str(tmp_path / "original")), tmp_path / "store", limit=4)
    run(cfg)
    files = FeatureStore(tmp_path / "store").manifest["target"]["weight_files"]
    assert list(files) == ["model.safetensors"] and len(files["model.safetensors"]) == 64
    (tmp_path / "original" / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes())
    with pytest.raises(
        StoreMismatchError, match=r"target\.weight_files\.model\.safetensors: expected '[0-9a-f]{64}', found"
    ) as err:
        run(cfg)
    assert "target.weights." not in str(err.value)  # the embedding and LM head are the same


def test_a_bad_record_after_the_first_shard_names_it_and_writes_no_manifest(target_cfg, tmp_path):
    """The file is streamed, so a bad record late in it is found after earlier shards were
    written: the error names the file and the line, and no manifest makes the store look complete."""
    records = json.loads(open(ALPACA).read())[:300]  # more than one tokenizer batch (256)
    bad = tmp_path / "late.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"id": "x", "conversations": [\n')
    with pytest.raises(
        DataError, match=r"late.jsonl: malformed JSON on line 301 .*rerun with overwrite=true"
    ):
        run(extract_cfg(target_cfg, tmp_path / "store", path=bad, limit=None, shard_samples=50))
    assert (tmp_path / "store" / shard_name(0)).exists() and not (tmp_path / "store" / MANIFEST_NAME).exists()


# What tokenizing adds to the resident set: the peak (VmHWM, reset to the current size just before the
# call where /proc/self/clear_refs allows it; else the peak so far, which only over-counts) less the size
# before it, so the interpreter, torch and the 20 MB input itself are not counted.
MEMORY_SCRIPT = """
import datasets
from omegaconf import OmegaConf
from eagle_train.config import TargetConfig
from eagle_train.config.base import CONF_DIR, to_schema
from eagle_train.data.render import ChatRenderer, tokenize_conversations
from eagle_train.modeling.target import load_tokenizer
def status(key):
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) // 1024
cfg = to_schema(OmegaConf.load(CONF_DIR / "target" / "stories260k.yaml"), TargetConfig)
story = "Once upon a time there was a cat. " * (20 * 2**20 // 34)
messages = [{"role": "user", "content": "Tell a long story."}, {"role": "assistant", "content": story}]
rows = datasets.Dataset.from_dict({"id": ["a"], "messages": [messages]})
renderer = ChatRenderer(load_tokenizer(cfg), cfg, 256)
try:
    open("/proc/self/clear_refs", "w").write("5")
except OSError:
    pass
before = status("VmRSS")
out, _ = tokenize_conversations(rows, renderer)
print(out[0]["num_tokens"], status("VmHWM") - before)
"""


@pytest.mark.slow
def test_a_20_mb_message_costs_no_more_memory_than_max_len_tokens(target_cfg, tmp_path):
    """The text beyond what max_len tokens can hold is cut before tokenizing: tokenizing a 20 MB reply with
    max_len 256 adds a few tens of MB to the resident set (43 MB measured here; 2041 MB with the cut
    turned off; the whole extract process's peak: scripts/bench_extract_memory.py), and the kept tokens
    are those of the whole text (checked on a 200 kB reply)."""
    from eagle_train.data.render import ChatRenderer
    from eagle_train.modeling.target import load_tokenizer

    words = " ".join(f"word{k % 997} and more" for k in range(12_000))  # ~200 kB
    tokenizer = load_tokenizer(target_cfg)
    messages = [{"role": "user", "content": "Tell a long story."}, {"role": "assistant", "content": words}]
    renderer = ChatRenderer(tokenizer, target_cfg, 256)
    whole = tokenizer("".join(t for t, _ in renderer.segments(messages)), add_special_tokens=False)
    assert renderer.render(messages).input_ids == whole["input_ids"][:256]
    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    tokens, added_mb = map(int, done.stdout.split())
    assert tokens == 256 and added_mb < 300, added_mb
