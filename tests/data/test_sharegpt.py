"""ShareGPT loading: formats, the normalisation policy, ids, the id-hash split, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle_train.config.data import DataConfig
from eagle_train.data.sharegpt import (
    DataError,
    DropReport,
    is_eval_id,
    iter_records,
    load_conversations,
    load_sharegpt,
    split_by_id,
)
from tests.conftest import DATA

SHAREGPT = DATA / "sharegpt"


def write_json(path: Path, records: list) -> Path:
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def conv(
    *turns: tuple[str, str | None], id: str | None = "c", key: str = "conversations", style: str = "from"
) -> dict:
    names = ("from", "value") if style == "from" else ("role", "content")
    record = {key: [{names[0]: r, names[1]: c} for r, c in turns]}
    if id is not None:
        record["id"] = id
    return record


def test_three_variants_normalise_to_the_same_messages(tmp_path):
    expected = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    a = write_json(tmp_path / "a.json", [conv(("system", "Be brief."), ("human", "Hi"), ("gpt", "Hello"))])
    b = write_jsonl(
        tmp_path / "b.jsonl",
        [conv(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), style="role")],
    )
    c = write_jsonl(
        tmp_path / "c.jsonl",
        [conv(("SYSTEM", "Be brief."), ("User", "Hi"), ("model", "Hello"), key="messages", style="role")],
    )
    for path in (a, b, c):
        ds, report = load_sharegpt(path)
        assert ds.column_names == ["id", "messages"]
        assert ds[0] == {"id": "c", "messages": expected}, path
        assert report.seen == 1 and report.total == 0 and not report.fixes


@pytest.mark.parametrize("role", ["gpt", "assistant", "chatgpt", "bard", "model"])
def test_assistant_role_names(tmp_path, role):
    ds, _ = load_sharegpt(write_json(tmp_path / "x.json", [conv(("human", "q"), (role, "a"))]))
    assert [m["role"] for m in ds[0]["messages"]] == ["user", "assistant"]


def test_policy_fixes_and_drops_are_counted(tmp_path):
    records = [
        conv(("gpt", "Hi, how can I help?"), ("human", "q"), ("gpt", "a"), id="leading"),
        conv(("human", "q1"), ("human", "q2"), ("gpt", "a1"), ("gpt", "a2"), id="repeated"),
        conv(("human", "q"), ("gpt", "   "), ("human", "q2"), ("gpt", None), ("gpt", "a"), id="empty"),
        conv(("human", "q"), ("tool", "{}"), ("gpt", "a"), id="unknown"),
        conv(
            ("human", "q"), ("gpt", "a"), ("system", "late"), ("human", "q2"), ("gpt", "a2"), id="sys_inside"
        ),
        conv(("human", "q"), ("gpt", "a"), ("human", "unanswered"), id="trailing"),
        conv(("human", "only a question"), id="no_reply"),
        conv(("gpt", ""), ("human", " "), id="empty_conv"),
    ]
    ds, report = load_sharegpt(write_json(tmp_path / "p.json", records))
    rows = {r["id"]: [(m["role"], m["content"]) for m in r["messages"]] for r in ds}
    assert rows == {
        "leading": [("user", "q"), ("assistant", "a")],
        "repeated": [("user", "q1\n\nq2"), ("assistant", "a1\n\na2")],
        "empty": [("user", "q\n\nq2"), ("assistant", "a")],
        "trailing": [("user", "q"), ("assistant", "a")],
    }
    assert report.counts == {
        "unknown_role": 1,
        "system_turn_inside": 1,
        "no_assistant_turn": 1,
        "empty_conversation": 1,
    }
    assert report.fixes == {
        "leading_assistant_removed": 1,
        "repeated_role_merged": 2,
        "empty_turn_removed": 1,
        "trailing_user_removed": 1,
    }
    assert (report.seen, report.total, report.kept) == (8, 4, 4)
    assert "8 conversations, 4 dropped" in report.format() and "unknown_role 1" in str(report)


def test_strict_policies_drop_instead_of_fixing(tmp_path):
    path = write_json(
        tmp_path / "p.json",
        [
            conv(("gpt", "hi"), ("human", "q"), ("gpt", "a"), id="x"),
            conv(("human", "q"), ("human", "q"), ("gpt", "a"), id="y"),
        ],
    )
    ds, report = load_sharegpt(
        path, leading_assistant="drop_conversation", repeated_roles="drop_conversation"
    )
    assert len(ds) == 0 and report.counts == {"leading_assistant": 1, "repeated_role": 1}


def test_ids_generated_and_deduplicated(tmp_path):
    records = [conv(("human", "q"), ("gpt", "a"), id=None), conv(("human", "q"), ("gpt", "a"), id=7)]
    records += [conv(("human", "q"), ("gpt", "a"), id="7")]
    ds, report = load_sharegpt(write_jsonl(tmp_path / "my_chats.jsonl", records))
    assert ds["id"] == ["my_chats_0", "7", "7_dup1"]
    assert report.fixes == {"duplicate_id_renamed": 1}


def test_a_renamed_id_never_collides_with_a_later_one(tmp_path):
    """`x, x, x_dup1` gives `x, x_dup1, x_dup1_dup1`, never a second `x_dup1` (which regenerate would drop
    and training would refuse in a store): every id of a file is unique by construction."""
    ids = ["x", "x", "x_dup1", "x", "x_dup1"]
    records = [conv(("human", "q"), ("gpt", "a"), id=i) for i in ids]
    ds, report = load_sharegpt(write_jsonl(tmp_path / "dups.jsonl", records))
    assert ds["id"] == ["x", "x_dup1", "x_dup1_dup1", "x_dup2", "x_dup1_dup2"]
    assert report.fixes == {"duplicate_id_renamed": 4}


def test_limit_counts_kept_conversations(tmp_path):
    records = [conv(("human", "q"), id="bad")] + [
        conv(("human", "q"), ("gpt", "a"), id=str(i)) for i in range(5)
    ]
    ds, report = load_sharegpt(write_json(tmp_path / "x.json", records), limit=2)
    assert ds["id"] == ["0", "1"] and report.seen == 3 and report.counts == {"no_assistant_turn": 1}


def test_prompt_only_file_points_to_regeneration():
    path = SHAREGPT / "sharegpt_v3_filtered_1000_first_prompts.json"
    with pytest.raises(
        DataError, match=r"sharegpt_v3_filtered_1000_first_prompts\.json.*eagle_train\.regenerate"
    ):
        load_sharegpt(path)
    ds, report = load_sharegpt(path, require_replies=False)
    assert len(ds) == 1000 and report.total == 0
    assert all(len(m) == 1 and m[0]["role"] == "user" for m in ds["messages"])
    assert ds[0]["id"] == "wc1OQ5t_9"


def test_without_replies_keeps_prompts_and_drops_reply_only(tmp_path):
    path = write_json(
        tmp_path / "x.json",
        [conv(("human", "q"), ("gpt", "a"), ("human", "next")), conv(("gpt", "a"), id="d")],
    )
    ds, report = load_sharegpt(path, require_replies=False)
    assert [m["role"] for m in ds[0]["messages"]] == ["user", "assistant", "user"]
    assert report.counts == {"no_user_turn": 1}


def test_shared_files_load_completely():
    dummy, report = load_sharegpt(SHAREGPT / "fastchat_dummy_conversation.json")
    assert len(dummy) == 500 and report.total == 0 and dummy[0]["id"] == "identity_0"
    assert sum(len(m) for m in dummy["messages"]) == 2000
    alpaca, report = load_sharegpt(SHAREGPT / "alpaca_cleaned_1000_as_sharegpt.json")
    assert len(alpaca) == 1000 and report.total == 0


def test_load_conversations_uses_the_config(tmp_path):
    path = write_json(
        tmp_path / "x.json", [conv(("gpt", "hi"), ("human", "q"), ("gpt", "a"), id=str(i)) for i in range(4)]
    )
    cfg = DataConfig(name="x", path=str(path), limit=3, leading_assistant="drop_conversation")
    ds, report = load_conversations(cfg)
    assert len(ds) == 0 and report.counts == {"leading_assistant": 4}
    with pytest.raises(DataError, match="not found"):
        load_conversations(DataConfig(path=str(tmp_path / "missing.jsonl")))


def test_split_by_id_is_deterministic_and_stable():
    ds, _ = load_sharegpt(SHAREGPT / "alpaca_cleaned_1000_as_sharegpt.json")
    train, held = split_by_id(ds, 0.1)
    assert len(train) + len(held) == 1000 and 60 <= len(held) <= 140
    assert not set(train["id"]) & set(held["id"])
    _, held_small = split_by_id(ds.select(range(500)), 0.1)
    assert set(held_small["id"]) == {i for i in held["id"] if int(i.rsplit("_", 1)[1]) < 500}
    assert split_by_id(ds, 0.0)[1].num_rows == 0 and not is_eval_id("anything", 0.0)


def test_drop_report_merge():
    a, b = DropReport(seen=10), DropReport(seen=8)
    a.drop("x", 2)
    b.drop("x")
    b.drop("y")
    b.fix("z")
    merged = a.merge(b)
    assert merged.counts == {"x": 3, "y": 1} and merged.fixes == {"z": 1} and merged.seen == 10
    assert merged.to_dict() == {"seen": 10, "dropped": 4, "counts": {"x": 3, "y": 1}, "fixes": {"z": 1}}


def test_missing_directory_and_empty_files(tmp_path):
    with pytest.raises(DataError, match=r"nope\.json: data file not found"):
        load_sharegpt(tmp_path / "nope.json")
    with pytest.raises(DataError, match="is a directory"):
        load_sharegpt(tmp_path)
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(DataError, match=r"empty\.json: file is empty"):
        load_sharegpt(tmp_path / "empty.json")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"blank\.jsonl: file is empty"):
        load_sharegpt(tmp_path / "blank.jsonl")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(DataError, match="not UTF-8"):
        load_sharegpt(tmp_path / "binary.json")


def test_single_object_and_one_line_files(tmp_path):
    (tmp_path / "one.json").write_text(json.dumps(conv(("human", "q"), ("gpt", "a")), indent=2))
    assert load_sharegpt(tmp_path / "one.json")[0]["id"] == ["c"]
    (tmp_path / "one.jsonl").write_text(json.dumps(conv(("human", "q"), ("gpt", "a"))) + "\n")
    assert load_sharegpt(tmp_path / "one.jsonl")[0]["id"] == ["c"]
    (tmp_path / "empty_array.json").write_text("[]")
    with pytest.raises(DataError, match="no conversation records"):
        load_sharegpt(tmp_path / "empty_array.json")


def test_malformed_json_names_file_and_line(tmp_path):
    good = json.dumps(conv(("human", "q"), ("gpt", "a")))
    (tmp_path / "bad.jsonl").write_text(good + "\n\n" + good + "\n" + '{"id": "x", "conversations": [\n')
    with pytest.raises(DataError, match=r"bad\.jsonl: malformed JSON on line 4 \(record 2\)"):
        load_sharegpt(tmp_path / "bad.jsonl")
    (tmp_path / "bad.json").write_text("[\n" + good + ",\n" + good + "\n")
    with pytest.raises(DataError, match=r"bad\.json: malformed JSON at line 4"):
        load_sharegpt(tmp_path / "bad.json")


@pytest.mark.parametrize(
    "record, reason",
    [
        ([1, 2], "must be a JSON object"),
        ({"id": "r1", "text": "hello"}, "no 'conversations' or 'messages'"),
        ({"id": "r1", "conversations": "hello"}, "must be a list"),
        ({"id": "r1", "conversations": [{"speaker": "human", "text": "q"}]}, "turn 0 needs 'from'/'value'"),
        ({"id": "r1", "conversations": [{"from": "human", "value": 3}]}, "turn 0: content must be a string"),
    ],
)
def test_wrong_schema_names_the_record(tmp_path, record, reason):
    records = [conv(("human", "q"), ("gpt", "a"), id="ok"), record]
    with pytest.raises(DataError, match="wrong schema") as info:
        load_sharegpt(write_json(tmp_path / "s.json", records))
    message = str(info.value)
    assert "s.json" in message and "record 1" in message and reason in message
    if isinstance(record, dict) and "id" in record:
        assert "'r1'" in message


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_json_arrays_are_read_as_a_stream_in_any_chunk_size(tmp_path, chunk):
    """A JSON array is decoded element by element (memory: one chunk and one record), with the
    same records, whitespace and all, as reading it whole."""
    records = [
        conv(("human", f'q {k} \u00e9 \\"]}}{{[,'), ("gpt", "a" * (5 * k)), id=f"r{k}") for k in range(25)
    ] + [
        {
            "id": 12345678901234567890,
            "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}],
        }
    ]
    path = tmp_path / "a.json"
    path.write_text(
        "  \n[ " + ",\n\t".join(json.dumps(r, indent=k % 3 or None) for k, r in enumerate(records)) + " ]\n"
    )
    got = [record for _, _, record in iter_records(path, chunk=chunk)]
    assert got == json.loads(path.read_text())
    path.write_text(json.dumps(records)[:-1] + ", 3 x]")
    with pytest.raises(
        DataError, match=r"a.json: malformed JSON at line 1, column \d+: Expecting ',' delimiter"
    ):
        list(iter_records(path, chunk=chunk))


@pytest.mark.parametrize(
    "text, message",
    [
        (
            '[{"id": "a", "conversations": [{"from": "human", "value": "hi \\ud800"}]}]',
            "lone surrogate '\\\\ud800'",
        ),
        ('{"id": "a", "conversations": [{"from": "human\\udfff", "value": "hi"}]}\n', "lone surrogate"),
        ("[" * 100_000 + "]" * 100_000, "record 0: nested too deeply"),
        (
            '{"id": "a", "conversations": []}\n' + "[" * 100_000 + "]" * 100_000 + "\n",
            "line 2 .*nested too deeply",
        ),
    ],
    ids=["surrogate-content", "surrogate-role", "deep-array", "deep-jsonl"],
)
def test_hostile_json_is_a_data_error_naming_the_record(tmp_path, text, message):
    """A lone surrogate (valid JSON, invalid text) or a very deep document: a DataError naming the
    file and the record, not a UnicodeEncodeError or RecursionError later."""
    path = tmp_path / ("h.jsonl" if text.startswith("{") else "h.json")
    path.write_text(text)
    with pytest.raises(DataError, match=rf"h\.jsonl?: .*{message}"):
        load_sharegpt(path, require_replies=False)
