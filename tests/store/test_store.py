"""The feature store on its own: shard writing, the manifest, resumability checks and the checked reader."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from eagle_train.store.codec import decode
from eagle_train.store.manifest import (
    MANIFEST_NAME,
    STORE_CONFIG_NAME,
    StoreError,
    StoreMismatchError,
    store_hash,
)
from eagle_train.store.reader import FeatureStore
from eagle_train.store.shard import ShardFile, token_dtype
from eagle_train.store.writer import (
    completed_shard,
    plan_shards,
    prepare_out_dir,
    shard_name,
    write_manifest,
    write_shard,
)
from tests.conftest import reseal

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
    identity = {**IDENTITY, "dtype": dtype, "target": {**IDENTITY["target"], "vocab_size": vocab}}
    prepare_out_dir(path, identity, overwrite=False)
    for k, (start, stop) in enumerate(plan):
        extra = {"start": start, "stop": stop, "store": store_hash(identity)}
        write_shard(path, k, samples[start:stop], dtype, vocab, extra=extra)
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
    with pytest.raises(
        StoreMismatchError, match=r"manifest.json: schema_version: this version reads \[1, 2\], found 0"
    ):
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
    # a renamed data set (same file contents) is the same store: shards and manifest kept (the manifest
    # is replaced at the end of the run, or removed when a shard is written again)
    prepare_out_dir(tmp_path, {**IDENTITY, "data": {**IDENTITY["data"], "name": "renamed"}}, overwrite=False)
    assert (tmp_path / shard_name(1)).exists() and (tmp_path / MANIFEST_NAME).exists()
    write_shard(tmp_path, 1, make_samples([2]), "float32", 512, extra={"start": 1, "stop": 2})
    assert not (tmp_path / MANIFEST_NAME).exists()
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
    with pytest.raises(StoreMismatchError, match=r"aux_layers: expected '<missing>', found \[1, 2, 4\]"):
        prepare_out_dir(tmp_path, IDENTITY, overwrite=False)
    with pytest.raises(StoreMismatchError, match=r"aux_layers: expected \[0, 2, 4\], found \[1, 2, 4\]"):
        prepare_out_dir(tmp_path, {**IDENTITY, "aux_layers": [0, 2, 4]}, overwrite=False)
    with pytest.raises(StoreMismatchError, match=r"aux_layers: expected \[1, 2, 4\], found '<missing>'"):
        prepare_out_dir(plain, identity, overwrite=False)


def test_a_manifest_naming_aux_layers_needs_aux_tensors(tmp_path):
    build_store(tmp_path, make_samples([4]), [(0, 1)])
    write_manifest(tmp_path, {**IDENTITY, "aux_layers": [1, 2, 4]}, [(0, 1)], {}, "h")
    with pytest.raises(StoreError, match="no `aux` tensor"):
        FeatureStore(tmp_path)


# ---------------------------------------------------------------- checked reads


NUMPY = {
    "I64": np.int64,
    "U16": np.uint16,
    "I32": np.int32,
    "U8": np.uint8,
    "F32": np.float32,
    "BF16": np.uint16,
}


def edit_tensor(path, index, name, edit):
    """Apply `edit(numpy view)` to one tensor of a shard file in place."""
    shard = ShardFile(path / shard_name(index))
    spec = shard.header[name]
    begin, end = spec["data_offsets"]
    dtype = np.dtype(NUMPY[spec["dtype"]])
    data = bytearray((path / shard_name(index)).read_bytes())
    view = np.frombuffer(
        data, dtype=dtype, offset=shard.data_start + begin, count=(end - begin) // dtype.itemsize
    )
    view.flags.writeable = True
    edit(view)
    (path / shard_name(index)).write_bytes(bytes(data))


def test_flipped_bytes_are_caught_before_the_shard_is_used(tmp_path):
    build_store(tmp_path, make_samples([40, 40]), [(0, 1), (1, 2)])
    shard = ShardFile(tmp_path / shard_name(1))
    at = shard.data_start + shard.header["hidden"]["data_offsets"][0] + 16
    data = bytearray((tmp_path / shard_name(1)).read_bytes())
    data[at : at + 64] = b"\xff" * 64  # 64 bytes of the hidden states: NaNs
    (tmp_path / shard_name(1)).write_bytes(bytes(data))
    store = FeatureStore(tmp_path)  # opening reads headers only
    assert store[0]["id"] == "s0"  # shard 0 is intact
    with pytest.raises(StoreError, match=r"shard-00001.safetensors: its checksum \(sha256\) differs"):
        store[1]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: edit_tensor(d, 1, "offsets", lambda v: v.__setitem__(1, 99)), "offsets must rise from 0"),
        (lambda d: edit_tensor(d, 1, "offsets", lambda v: v.__setitem__(2, 3)), "offsets must rise from 0"),
        (
            lambda d: edit_tensor(d, 1, "input_ids", lambda v: v.__setitem__(0, 600)),
            "token ids .* leave the vocabulary of 512",
        ),
        (lambda d: edit_tensor(d, 1, "loss_mask", lambda v: v.__setitem__(0, 7)), "loss mask holds values"),
        (
            lambda d: (d / shard_name(1)).write_bytes((d / shard_name(1)).read_bytes()[:-5]),
            "its header describes",
        ),
        (lambda d: (d / shard_name(1)).write_bytes(b"\x01\x00"), "no safetensors header"),
        (lambda d: (d / shard_name(1)).write_bytes(b"\xff" * 64), "header length .* runs past the end"),
    ],
    ids=["offsets-beyond", "offsets-decrease", "token-id", "mask", "truncated", "tiny", "header-length"],
)
def test_edited_shards_are_refused_even_with_matching_checksums(tmp_path, edit, message):
    build_store(tmp_path, make_samples([3, 4, 5]), [(0, 1), (1, 3)])
    edit(tmp_path)
    reseal(tmp_path, 1)
    with pytest.raises(StoreError, match=message):
        FeatureStore(tmp_path).verify()


def test_a_duplicated_shard_is_refused(tmp_path):
    samples = make_samples([3, 4, 5, 6])
    build_store(tmp_path, samples, [(0, 2), (2, 4)])
    shutil.copy(tmp_path / shard_name(0), tmp_path / shard_name(1))  # shard 1 replaced by a copy of shard 0
    reseal(tmp_path, 1)
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    manifest["shards"][1]["num_tokens"] = manifest["shards"][0]["num_tokens"]
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="sample id 's0' is in shard-00000.safetensors and shard-00001"):
        FeatureStore(tmp_path)
    manifest["shards"][1]["start"] = 1  # a manifest whose ranges overlap
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="shard entry 1 .* does not follow the one before"):
        FeatureStore(tmp_path)


def test_identical_samples_give_identical_shard_bytes(tmp_path):
    """The bytes (and so the checksum) are a function of the samples (safetensors' own writer
    orders its metadata at random), and the file stays loadable by safetensors itself."""
    samples = make_samples([5, 3])
    digests = set()
    for k in range(6):
        info = write_shard(tmp_path / f"s{k}", 0, samples, "bfloat16", 512, extra={"start": 0, "stop": 2})
        digests.add(info["sha256"])
    assert len(digests) == 1
    with safe_open(str(tmp_path / "s0" / shard_name(0)), "pt") as f:
        assert torch.equal(f.get_tensor("hidden")[5:], samples[1]["hidden"].to(torch.bfloat16))
        assert json.loads(f.metadata()["ids"]) == ["s0", "s1"]


@pytest.mark.parametrize("broken", [MANIFEST_NAME, STORE_CONFIG_NAME, "both"])
def test_broken_metadata_is_named_and_a_rerun_repairs_it(tmp_path, broken):
    """A truncated manifest.json names the file when read; a rerun of the extraction over broken
    metadata rewrites it and keeps the shards."""
    build_store(tmp_path, make_samples([2, 3]), [(0, 1), (1, 2)])
    for name in [MANIFEST_NAME, STORE_CONFIG_NAME] if broken == "both" else [broken]:
        (tmp_path / name).write_text('{"schema_version": 1, "shards": [')
    if broken != STORE_CONFIG_NAME:
        with pytest.raises(
            StoreError, match=r"manifest.json \(feature store manifest\): not valid JSON .*line 1"
        ):
            FeatureStore(tmp_path)
    prepare_out_dir(tmp_path, IDENTITY, overwrite=False)
    assert json.loads((tmp_path / STORE_CONFIG_NAME).read_text()) == IDENTITY
    assert (tmp_path / shard_name(1)).exists()


def test_a_resumed_extraction_does_not_reread_verified_shards(tmp_path):
    """completed_shard trusts a shard whose size, mtime and inode are those it was verified with
    (a resume does not re-hash the store); any change makes it hash the file again."""
    build_store(tmp_path, make_samples([30, 30]), [(0, 1), (1, 2)])
    shard = tmp_path / shard_name(1)
    stat = shard.stat()
    with shard.open("r+b") as f:  # a change that keeps size, mtime and inode: not seen, by design
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(b"\x01" if last == b"\x00" else b"\x00")
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert completed_shard(tmp_path, 1, {"start": 1, "stop": 2}) is not None
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # touched: hashed again, and refused
    assert completed_shard(tmp_path, 1, {"start": 1, "stop": 2}) is None
    with pytest.raises(StoreError, match="checksum"):
        FeatureStore(tmp_path).verify()  # training still verifies every shard it reads


# ---------------------------------------------------------------- 14: fp8 stores, dtype checks


def test_fp8_store_takes_half_the_bytes_and_decodes_within_e4m3_rounding(tmp_path):
    wide = 512  # at d = 512 one fp8 token is 512 + 4 bytes of features, bf16's 1024
    gen = torch.Generator().manual_seed(0)
    samples = [
        {
            "id": f"s{i}",
            "input_ids": list(range(n)),
            "loss_mask": [1] * n,
            "hidden": torch.randn(n, wide, generator=gen),
        }
        for i, n in enumerate([30, 50])
    ]
    sizes = {}
    for dtype in ("bfloat16", "fp8"):
        identity = {**IDENTITY, "dtype": dtype, "target": {**IDENTITY["target"], "hidden_size": wide}}
        prepare_out_dir(tmp_path / dtype, identity, overwrite=False)
        extra = {"start": 0, "stop": 2, "store": store_hash(identity)}
        write_shard(tmp_path / dtype, 0, samples, dtype, 512, extra=extra)
        sizes[dtype] = write_manifest(tmp_path / dtype, identity, [(0, 2)], {}, "h")["counts"][
            "bytes_per_token"
        ]
    store = FeatureStore(tmp_path / "fp8")
    got = store[1]
    assert got["hidden"].dtype == torch.float8_e4m3fn and got["hidden_scale"].shape == (50, 1)
    back = decode(got["hidden"], got["hidden_scale"], torch.float32)
    assert bool(((back - samples[1]["hidden"]).abs() <= samples[1]["hidden"].abs() / 16 + 1e-3).all())
    assert 0.5 < sizes["fp8"] / sizes["bfloat16"] < 0.51  # 519 / 1027 bytes per token, header included


def test_a_shard_written_with_another_dtype_than_the_manifest_says_is_named(tmp_path):
    build_store(tmp_path, make_samples([3, 4]), [(0, 1), (1, 2)], dtype="bfloat16")
    other = tmp_path / "other"
    build_store(other, make_samples([3, 4]), [(0, 1), (1, 2)], dtype="float16")
    shutil.copy(other / shard_name(1), tmp_path / shard_name(1))
    reseal(tmp_path, 1)
    with pytest.raises(
        StoreError, match=r"shard-00001.safetensors: tensor 'hidden' is stored as F16, .*dtype=bfloat16"
    ):
        FeatureStore(tmp_path)


def test_an_fp8_store_on_a_torch_without_float8_names_the_manifest_and_field(tmp_path, monkeypatch):
    import eagle_train.store.codec as codec

    build_store(tmp_path, make_samples([3]), [(0, 1)], dtype="fp8")
    monkeypatch.setattr(codec, "float8_dtype", lambda: None)
    with pytest.raises(StoreError, match=r"manifest.json: dtype: dtype=fp8 needs torch.float8_e4m3fn"):
        FeatureStore(tmp_path)


def test_an_eagle3_fp8_store_scales_each_aux_state_alone(tmp_path):
    """EAGLE-3's aux features [L, 3 * hidden] in fp8: one scale per token per hidden state (three per
    row), so a quiet layer's state is not rounded on a loud one's scale; the hidden states as in EAGLE-1."""
    gen = torch.Generator().manual_seed(3)
    samples = make_samples([6, 9])
    for s in samples:  # the three states at very different magnitudes, as low / mid / high layers are
        states = [torch.randn(len(s["input_ids"]), HIDDEN, generator=gen) * m for m in (0.01, 1.0, 300.0)]
        s["aux"] = torch.cat(states, dim=-1)
    identity = {**IDENTITY, "dtype": "fp8", "aux_layers": [1, 2, 4]}
    prepare_out_dir(tmp_path, identity, overwrite=False)
    write_shard(
        tmp_path, 0, samples, "fp8", 512, extra={"start": 0, "stop": 2, "store": store_hash(identity)}
    )
    write_manifest(tmp_path, identity, [(0, 2)], {}, "h")
    store = FeatureStore(tmp_path, aux=True)
    for i, s in enumerate(samples):
        got = store[i]
        assert got["aux"].dtype == torch.float8_e4m3fn and got["aux_scale"].shape == (len(s["input_ids"]), 3)
        back = decode(got["aux"], got["aux_scale"], torch.float32)
        ref = s["aux"]
        for k in range(3):  # each state within e4m3's relative step of its own values
            part, want = back[:, k * HIDDEN : (k + 1) * HIDDEN], ref[:, k * HIDDEN : (k + 1) * HIDDEN]
            scale = want.abs().amax(-1, keepdim=True)
            assert bool(((part - want).abs() <= want.abs() / 16 + scale / 448).all()), k
