"""The feature store on its own: shard writing, the manifest, resumability checks and the mmap reader."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from eagle_train.store import (
    MANIFEST_NAME,
    STORE_CONFIG_NAME,
    FeatureStore,
    StoreError,
    StoreMismatchError,
    completed_shard,
    plan_shards,
    prepare_out_dir,
    shard_name,
    token_dtype,
    write_manifest,
    write_shard,
)

HIDDEN = 8
IDENTITY = {
    "schema_version": 1,
    "target": {
        "name": "toy",
        "source": "/models/toy",
        "config_hash": "abc",
        "hidden_size": HIDDEN,
        "vocab_size": 512,
    },
    "dtype": "float32",
    "template": "plain",
    "max_len": 64,
    "data": {"name": "toy", "path": "/data/toy.json", "sha256": "d00d"},
}


def make_samples(lengths, vocab=512, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "id": f"s{i}",
            "input_ids": torch.randint(0, vocab, (n,), generator=gen).tolist(),
            "loss_mask": (torch.rand(n, generator=gen) > 0.5).tolist(),
            "hidden": torch.randn(n, HIDDEN, generator=gen),
        }
        for i, n in enumerate(lengths)
    ]


def build_store(path, samples, plan, dtype="float32", vocab=512):
    identity = {**IDENTITY, "dtype": dtype}
    prepare_out_dir(path, identity, overwrite=False)
    for k, (start, stop) in enumerate(plan):
        write_shard(path, k, samples[start:stop], dtype, vocab, extra={"start": start, "stop": stop})
    return write_manifest(path, identity, plan, {"seen": len(samples), "counts": {"empty": 1}}, "hash")


def test_round_trip_over_shards(tmp_path):
    lengths = [5, 1, 9, 3, 7]
    samples = make_samples(lengths)
    manifest = build_store(tmp_path, samples, [(0, 2), (2, 5)])
    store = FeatureStore(tmp_path)
    assert len(store) == 5 and store.lengths == lengths and store.ids == [s["id"] for s in samples]
    assert manifest["counts"]["tokens"] == sum(lengths) and manifest["counts"]["skipped"] == {"empty": 1}
    assert [s["num_samples"] for s in store.manifest["shards"]] == [2, 3]
    for i in [0, 1, 4, 2, -1]:
        got, want = store[i], samples[i]
        assert got["id"] == want["id"]
        assert got["input_ids"].dtype == torch.long and got["input_ids"].tolist() == want["input_ids"]
        assert got["loss_mask"].dtype == torch.bool and got["loss_mask"].tolist() == want["loss_mask"]
        assert torch.equal(got["hidden"], want["hidden"])
    with pytest.raises(IndexError):
        store[5]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_hidden(tmp_path, dtype):
    samples = make_samples([4, 6])
    build_store(tmp_path, samples, [(0, 2)], dtype=dtype)
    store = FeatureStore(tmp_path)
    torch_dtype = getattr(torch, dtype)
    assert store[1]["hidden"].dtype == torch_dtype
    assert torch.equal(store[1]["hidden"], samples[1]["hidden"].to(torch_dtype))
    # 2 bytes per hidden value, 2 per token id (uint16), 1 per mask byte; plus header and offsets
    shard = store.manifest["shards"][0]
    assert shard["bytes"] >= 10 * (2 * HIDDEN + 3) and shard["bytes"] < 10 * (2 * HIDDEN + 3) + 600


def test_large_vocabulary_ids_round_trip(tmp_path):
    assert token_dtype(512) == torch.uint16 and token_dtype(65536) == torch.uint16
    assert token_dtype(151_936) == torch.int32
    samples = make_samples([3, 4], vocab=151_936)
    samples[0]["input_ids"][0] = 151_935
    build_store(tmp_path, samples, [(0, 2)], vocab=151_936)
    store = FeatureStore(tmp_path)
    assert store[0]["input_ids"].tolist() == samples[0]["input_ids"]


def test_picklable_for_dataloader_workers(tmp_path):
    samples = make_samples([3, 2])
    build_store(tmp_path, samples, [(0, 2)])
    store = FeatureStore(tmp_path)
    _ = store[0]  # opens the map
    clone = pickle.loads(pickle.dumps(store))
    assert torch.equal(clone[1]["hidden"], samples[1]["hidden"])


def test_check_compatible_names_the_field(tmp_path):
    build_store(tmp_path, make_samples([2]), [(0, 1)])
    store = FeatureStore(tmp_path)
    store.check_compatible({"target.hidden_size": HIDDEN, "target.vocab_size": 512, "dtype": "float32"})
    with pytest.raises(StoreMismatchError, match=r"target\.hidden_size: expected 4096, found 8"):
        store.check_compatible({"target.hidden_size": 4096, "target.vocab_size": 512})
    with pytest.raises(StoreMismatchError, match=r"template: expected 'llama3', found 'plain'"):
        store.check_compatible({"template": "llama3"})


def test_reader_refuses_incomplete_or_foreign_stores(tmp_path):
    with pytest.raises(StoreError, match="no manifest.json"):
        FeatureStore(tmp_path)
    build_store(tmp_path, make_samples([2, 3]), [(0, 1), (1, 2)])
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({**manifest, "schema_version": 0}))
    with pytest.raises(StoreMismatchError, match="schema_version: expected 1, found 0"):
        FeatureStore(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest))
    (tmp_path / shard_name(1)).unlink()
    with pytest.raises(StoreError, match="shard-00001.safetensors .* is missing"):
        FeatureStore(tmp_path)


def test_verify_and_completed_shard_detect_corruption(tmp_path):
    build_store(tmp_path, make_samples([4, 4]), [(0, 1), (1, 2)])
    assert completed_shard(tmp_path, 1, {"start": 1, "stop": 2}) is not None
    assert completed_shard(tmp_path, 1, {"start": 0, "stop": 2}) is None  # another plan
    FeatureStore(tmp_path).verify()
    shard = tmp_path / shard_name(1)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert completed_shard(tmp_path, 1, {"start": 1, "stop": 2}) is None
    with pytest.raises(StoreError, match="checksum"):
        FeatureStore(tmp_path).verify()
    (tmp_path / "shard-00000.json").unlink()
    assert completed_shard(tmp_path, 0, {"start": 0, "stop": 1}) is None


def test_plan_shards_is_contiguous_and_respects_limits():
    lengths = [10, 20, 5, 100, 1, 1, 1]
    by_samples = plan_shards(lengths, bytes_per_token=2, shard_samples=3, shard_bytes=10**9)
    assert by_samples == [(0, 3), (3, 6), (6, 7)]
    by_bytes = plan_shards(lengths, bytes_per_token=2, shard_samples=None, shard_bytes=70)
    # 20+40 = 60 fits, +10 -> 70 fits, the 200-byte sample gets a shard of its own
    assert by_bytes == [(0, 3), (3, 4), (4, 7)]
    assert plan_shards([], 2, None, 10) == []


def test_prepare_out_dir_refuses_other_config_unless_overwrite(tmp_path):
    build_store(tmp_path, make_samples([2, 2]), [(0, 1), (1, 2)])
    other = {**IDENTITY, "template": "chatml", "data": {**IDENTITY["data"], "sha256": "beef"}}
    with pytest.raises(StoreMismatchError, match=r"data\.sha256: expected 'beef', found 'd00d'.*template"):
        prepare_out_dir(tmp_path, other, overwrite=False)
    assert (tmp_path / MANIFEST_NAME).exists()  # refused: nothing touched
    # a renamed data set (same file contents) is the same store: shards kept, manifest pending
    prepare_out_dir(tmp_path, {**IDENTITY, "data": {**IDENTITY["data"], "name": "renamed"}}, overwrite=False)
    assert (tmp_path / shard_name(1)).exists() and not (tmp_path / MANIFEST_NAME).exists()
    prepare_out_dir(tmp_path, other, overwrite=True)
    assert not list(tmp_path.glob("shard-*")) and (tmp_path / STORE_CONFIG_NAME).exists()
    # the pending store config (no manifest yet) is what a rerun is checked against
    with pytest.raises(StoreMismatchError, match="store_config.json"):
        prepare_out_dir(tmp_path, IDENTITY, overwrite=False)


def test_write_manifest_needs_every_planned_shard(tmp_path):
    samples = make_samples([2, 2])
    prepare_out_dir(tmp_path, IDENTITY, overwrite=False)
    write_shard(tmp_path, 0, samples[:1], "float32", 512, extra={"start": 0, "stop": 1})
    with pytest.raises(StoreError, match="shard 1 .* missing"):
        write_manifest(tmp_path, IDENTITY, [(0, 1), (1, 2)], {}, "hash")
    assert not (tmp_path / MANIFEST_NAME).exists()


def test_aux_features_are_stored_and_read_beside_the_hidden_states(tmp_path):
    """An EAGLE-3 store: `aux` [L, 3 * hidden] per sample, `aux_layers` in the manifest; an EAGLE-1
    store's manifest has no such key and its samples no `aux` (the schema-1 layout, unchanged)."""
    samples = make_samples([5, 3, 7])
    gen = torch.Generator().manual_seed(9)
    for s in samples:
        s["aux"] = torch.randn(len(s["input_ids"]), 3 * HIDDEN, generator=gen)
    identity = {**IDENTITY, "aux_layers": [1, 2, 4]}
    prepare_out_dir(tmp_path, identity, overwrite=False)
    info = write_shard(tmp_path, 0, samples, "float32", 512, extra={"start": 0, "stop": 3})
    write_manifest(tmp_path, identity, [(0, 3)], {}, "h")
    store = FeatureStore(tmp_path, aux=True)
    assert store.aux_layers == [1, 2, 4] and info["bytes"] > 15 * 4 * HIDDEN * 4
    for i, s in enumerate(samples):
        assert torch.equal(store[i]["aux"], s["aux"]) and torch.equal(store[i]["hidden"], s["hidden"])
        ids, mask = store.tokens(i)
        assert ids.tolist() == s["input_ids"] and mask.tolist() == s["loss_mask"]
    plain = tmp_path / "plain"
    build_store(plain, make_samples([4]), [(0, 1)])
    write_manifest(plain, IDENTITY, [(0, 1)], {}, "h")
    assert FeatureStore(plain).aux_layers == [] and "aux" not in FeatureStore(plain)[0]
    # an EAGLE-1 run reads an EAGLE-3 store's hidden states only
    assert "aux" not in FeatureStore(tmp_path)[0]
    with pytest.raises(StoreError, match="no aux features"):
        FeatureStore(plain, aux=True)[0]
    assert "aux_layers" not in json.loads((plain / MANIFEST_NAME).read_text())
    # the same directory re-extracted without aux layers (or with others) is another store
    with pytest.raises(StoreMismatchError, match=r"aux_layers: expected None, found \[1, 2, 4\]"):
        prepare_out_dir(tmp_path, IDENTITY, overwrite=False)
    with pytest.raises(StoreMismatchError, match=r"aux_layers: expected \[0, 2, 4\], found \[1, 2, 4\]"):
        prepare_out_dir(tmp_path, {**IDENTITY, "aux_layers": [0, 2, 4]}, overwrite=False)
    with pytest.raises(StoreMismatchError, match=r"aux_layers: expected \[1, 2, 4\], found None"):
        prepare_out_dir(plain, identity, overwrite=False)


def test_a_manifest_naming_aux_layers_needs_aux_tensors(tmp_path):
    build_store(tmp_path, make_samples([4]), [(0, 1)])
    write_manifest(tmp_path, {**IDENTITY, "aux_layers": [1, 2, 4]}, [(0, 1)], {}, "h")
    with pytest.raises(StoreError, match="no `aux` tensor"):
        FeatureStore(tmp_path)
