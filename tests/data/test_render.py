"""Rendering and the assistant loss mask: golden tests per fallback template and for HF chat templates."""

from __future__ import annotations

import copy

import datasets
import pytest

from eagle_train.config.target import TargetConfig
from eagle_train.data.render import ChatRenderer, cut_segments, tokenize_conversations
from eagle_train.data.sharegpt import DataError
from eagle_train.modeling.target import load_tokenizer
from tests.data.conftest import masked_runs

CONV = [
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "Once upon a time, there was a cat."},
    {"role": "user", "content": "What was its name?"},
    {"role": "assistant", "content": "Its name was Tom."},
]
REPLIES = [CONV[1]["content"], CONV[3]["content"]]
SPECIALS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
]

# Exact text of CONV with the system prompt "Be nice." in each fallback format (the formats' own spelling).
GOLDEN_TEXT = {
    "plain": "<s>Be nice. Tell me a story. Once upon a time, there was a cat. What was its name? Its name was Tom.",
    "vicuna_v1.1": "<s>Be nice. USER: Tell me a story. ASSISTANT: Once upon a time, there was a cat.</s>"
    "USER: What was its name? ASSISTANT: Its name was Tom.</s>",
    "llama2_chat": "<s>[INST] <<SYS>>\nBe nice.\n<</SYS>>\n\nTell me a story. [/INST] Once upon a time, there was a cat. </s>"
    "<s>[INST] What was its name? [/INST] Its name was Tom. </s>",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe nice.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nTell me a story.<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nOnce upon a time, there was a cat.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWhat was its name?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nIts name was Tom.<|eot_id|>",
    "chatml": "<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nTell me a story.<|im_end|>\n"
    "<|im_start|>assistant\nOnce upon a time, there was a cat.<|im_end|>\n<|im_start|>user\nWhat was its name?<|im_end|>\n"
    "<|im_start|>assistant\nIts name was Tom.<|im_end|>\n",
}
END_OF_TURN = {
    "mistral": "</s>",
    "plain": "",
    "vicuna_v1.1": "</s>",
    "llama2_chat": " </s>",
    "llama3": "<|eot_id|>",
    "chatml": "<|im_end|>",
}
GENERATION_PROMPT_END = {
    "plain": "What was its name?",
    "vicuna_v1.1": "ASSISTANT:",
    "llama2_chat": "[/INST]",
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "chatml": "<|im_start|>assistant\n",
}

CHATML_JINJA = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_JINJA = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
MISTRAL_JINJA = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
# Not prefix-stable: the first line depends on the number of messages (replies are found all the same).
COUNTING_JINJA = "{{ 'Turns: ' + (messages | length) | string + '\\n' }}" + CHATML_JINJA


@pytest.fixture(scope="module")
def tokenizer(target_cfg):
    """The stories260K tokenizer with the chat formats' special tokens added (as real chat tokenizers have)."""
    tok = load_tokenizer(target_cfg)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


def with_template(tokenizer, jinja: str):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = jinja
    return tok


@pytest.mark.parametrize("name", sorted(GOLDEN_TEXT))
def test_fallback_template_golden(tokenizer, name):
    renderer = ChatRenderer(tokenizer, TargetConfig(chat_template=name, system_prompt="Be nice."))
    assert renderer.template_name == name
    assert "".join(text for text, _ in renderer.segments(CONV)) == GOLDEN_TEXT[name]
    rendered = renderer.render(CONV)
    assert rendered.input_ids == tokenizer(GOLDEN_TEXT[name], add_special_tokens=False)["input_ids"]
    runs = masked_runs(tokenizer, rendered.input_ids, rendered.loss_mask)
    assert [r.strip() for r in runs] == [(reply + END_OF_TURN[name]).strip() for reply in REPLIES]


@pytest.mark.parametrize("name", sorted(GOLDEN_TEXT))
def test_generation_prompt_is_the_prefix_before_the_last_reply(tokenizer, name):
    renderer = ChatRenderer(tokenizer, TargetConfig(chat_template=name))
    prompt = renderer.render_prompt(CONV[:3])
    full = renderer.render(CONV)
    text = "".join(t for t, _ in renderer.segments(CONV[:3], generation_prompt=True))
    assert text.endswith(GENERATION_PROMPT_END[name])
    assert prompt == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert full.input_ids[: len(prompt)] == prompt
    assert full.loss_mask[len(prompt)] == 1  # the first token after the header is the reply's
    assert (
        masked_runs(tokenizer, full.input_ids[len(prompt) :], full.loss_mask[len(prompt) :])[0].strip()
        == (REPLIES[1] + END_OF_TURN[name]).strip()
    )
    with pytest.raises(ValueError, match="end in a user turn"):
        renderer.render_prompt(CONV)


@pytest.mark.parametrize(
    "jinja, name",
    [
        (CHATML_JINJA, "chatml"),
        (LLAMA3_JINJA, "llama3"),
        (COUNTING_JINJA, "chatml"),
        (MISTRAL_JINJA, "mistral"),
    ],
)
@pytest.mark.quick
def test_hf_template_mask(tokenizer, jinja, name):
    tok = with_template(tokenizer, jinja)
    if name == "llama3":
        tok.bos_token = "<|begin_of_text|>"  # as in a real Llama-3 tokenizer
    renderer = ChatRenderer(tok, TargetConfig(chat_template="plain"))  # the tokenizer's own template wins
    assert renderer.template_name == "hf"
    conv = [{"role": "system", "content": "Be nice."}] + CONV
    rendered = renderer.render(conv)
    assert (
        rendered.input_ids
        == tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]
    )
    assert masked_runs(tok, rendered.input_ids, rendered.loss_mask) == [
        r + END_OF_TURN[name] for r in REPLIES
    ]
    if (
        name in GOLDEN_TEXT and jinja != COUNTING_JINJA
    ):  # same text as the fallback of the same name: same ids, same mask
        fallback = ChatRenderer(tok, TargetConfig(chat_template=name, force_template=True)).render(conv)
        assert (fallback.input_ids, fallback.loss_mask) == (rendered.input_ids, rendered.loss_mask)
    prompt = renderer.render_prompt(conv[:4])
    assert (
        prompt
        == tok(
            tok.apply_chat_template(conv[:4], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
    )


def test_hf_template_adds_default_system_prompt_unmasked(tokenizer):
    tok = with_template(tokenizer, CHATML_JINJA)
    rendered = ChatRenderer(tok, TargetConfig(system_prompt="Answer in rhymes.")).render(CONV)
    text = tok.decode(rendered.input_ids)
    assert "Answer in rhymes." in text and "helpful assistant" not in text
    assert masked_runs(tok, rendered.input_ids, rendered.loss_mask) == [r + "<|im_end|>" for r in REPLIES]


def test_missing_or_unknown_template_is_a_clear_error(tokenizer):
    with pytest.raises(
        ValueError, match=r"target 'mymodel' \(/models/m\): its tokenizer has no chat template"
    ):
        ChatRenderer(tokenizer, TargetConfig(name="mymodel", path="/models/m", chat_template=None))
    with pytest.raises(ValueError, match="unknown chat template 'zephyr'.*chatml"):
        ChatRenderer(tokenizer, TargetConfig(chat_template="zephyr"))
    with pytest.raises(ValueError, match="force_template is true"):
        ChatRenderer(
            with_template(tokenizer, CHATML_JINJA), TargetConfig(chat_template=None, force_template=True)
        )


def test_truncation_keeps_prefix_and_counts_cut_tokens(tokenizer):
    renderer = ChatRenderer(tokenizer, TargetConfig(chat_template="vicuna_v1.1"), max_len=20)
    full = ChatRenderer(tokenizer, TargetConfig(chat_template="vicuna_v1.1")).render(CONV)
    cut = renderer.render(CONV)
    assert len(cut.input_ids) == 20 and cut.truncated == len(full.input_ids) - 20
    assert (cut.input_ids, cut.loss_mask) == (full.input_ids[:20], full.loss_mask[:20])


def test_default_max_len_is_the_targets(tokenizer):
    assert (
        ChatRenderer(tokenizer, TargetConfig(chat_template="plain")).max_len == 512
    )  # tokenizer's model_max_length
    assert ChatRenderer(tokenizer, TargetConfig(chat_template="plain", max_len=64)).max_len == 64
    assert ChatRenderer(tokenizer, TargetConfig(chat_template="plain", max_len=64), max_len=32).max_len == 32


def test_slow_path_segment_tokenisation_matches_on_plain_text(tokenizer):
    from eagle_train.data.render import tokenize_by_segment

    segments = cut_segments("Tom had a dog. The dog ran fast.", [(15, 32)])
    assert segments == [("Tom had a dog. ", False), ("The dog ran fast.", True)]
    ids, mask = tokenize_by_segment(tokenizer, segments)
    assert tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "The dog ran fast."


def conversations(rows: list[tuple[str, list[dict]]]) -> datasets.Dataset:
    return datasets.Dataset.from_list([{"id": i, "messages": m} for i, m in rows])


def test_tokenize_conversations_columns_and_drops(tokenizer):
    long_prompt = [{"role": "user", "content": "Tell me a very long story. " * 30}, CONV[1]]
    ds = conversations([("a", CONV), ("long", long_prompt), ("no_reply", CONV[:1]), ("b", CONV[:2])])
    renderer = ChatRenderer(tokenizer, TargetConfig(chat_template="chatml"), max_len=64)
    out, report = tokenize_conversations(ds, renderer)
    assert out.column_names == ["id", "input_ids", "loss_mask", "num_tokens", "num_assistant_tokens"]
    assert out["id"] == ["a", "b"]
    assert (
        report.counts == {"no_assistant_tokens_after_truncation": 1, "no_assistant_tokens": 1}
        and report.seen == 4
    )
    for row in out:
        expected = renderer.render(ds[ds["id"].index(row["id"])]["messages"])
        assert (row["input_ids"], row["loss_mask"]) == (expected.input_ids, expected.loss_mask)
        assert (
            row["num_tokens"] == len(row["input_ids"])
            and row["num_assistant_tokens"] == sum(row["loss_mask"]) > 0
        )


def test_tokenize_conversations_names_a_conversation_the_template_rejects(tokenizer):
    tok = with_template(tokenizer, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(DataError, match="conversation 'x': cannot render it.*roles must alternate"):
        tokenize_conversations(conversations([("x", CONV)]), ChatRenderer(tok, TargetConfig()))


def test_tokenize_conversations_in_two_processes_matches_one(tokenizer):
    rows = [(f"c{i}", CONV[: 2 + 2 * (i % 2)]) for i in range(6)]
    renderer = ChatRenderer(tokenizer, TargetConfig(chat_template="llama3"))
    one, _ = tokenize_conversations(conversations(rows), renderer)
    two, _ = tokenize_conversations(conversations(rows), renderer, num_proc=2)
    assert one.to_list() == two.to_list()
