"""The assistant loss mask on the real published chat templates (tests/data/templates, sources in its README).

Each template runs on the embedded stories260K tokenizer with the template's special tokens added (as the
model's own tokenizer has them). The golden check: the decoded text of each run of masked tokens is
exactly one reply (or the answer of a reply whose reasoning the template does not render) followed by
its end-of-turn token, and the ids are exactly the tokenisation of the template's own text.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import pytest

from eagle_train.config.target import TargetConfig
from eagle_train.data.render import ChatRenderer, tokenize_conversations
from eagle_train.modeling.target import load_tokenizer
from tests.data.conftest import masked_runs

TEMPLATES = Path(__file__).parent / "templates"


@dataclass(frozen=True)
class Chat:
    """A published template and the tokens its model's tokenizer has."""

    file: str
    end_of_turn: str  # after every reply
    specials: list[str]  # special tokens the template writes
    header_like: str  # text that looks like the template's own assistant header
    bos: str | None = None
    eos: str | None = None
    last_end_of_turn: str | None = None  # after the last reply, if it differs
    reasoning: str = "verbatim"  # which replies keep their <think> block: verbatim (all) | last | never
    added: list[str] = field(default_factory=list)  # added tokens that are not special (<think>)


THINK = ["<think>", "</think>"]


def deepseek(file: str) -> Chat:
    """DeepSeek-R1's tokens (both revisions of its template)."""
    eos = "<｜end▁of▁sentence｜>"
    specials = ["<｜User｜>", "<｜Assistant｜>"]
    bos = "<｜begin▁of▁sentence｜>"
    return Chat(file, eos, specials, "<｜Assistant｜>", bos=bos, eos=eos, reasoning="never", added=THINK)


CHATS = {
    "llama3_1_8b_instruct": Chat(
        "llama3_1_8b_instruct.jinja",
        "<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>"],
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
    ),
    "qwen2_5_7b_instruct": Chat(
        "qwen2_5_7b_instruct.jinja", "<|im_end|>", ["<|im_start|>", "<|im_end|>"], "<|im_start|>assistant\n"
    ),
    "qwen3": Chat(
        "qwen3.jinja",
        "<|im_end|>",
        ["<|im_start|>", "<|im_end|>"],
        "<|im_start|>assistant\n",
        reasoning="last",
        added=THINK,
    ),
    "mistral_7b_instruct_v0_3": Chat(
        "mistral_7b_instruct_v0_3.jinja", "</s>", ["[INST]", "[/INST]"], "[/INST]"
    ),
    "deepseek_r1": deepseek("deepseek_r1.jinja"),
    "deepseek_r1_distill_qwen_32b": deepseek("deepseek_r1_distill_qwen_32b.jinja"),
    "gpt_oss": Chat(
        "gpt_oss.jinja",
        "<|end|>",
        ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>"],
        "<|start|>assistant<|message|>",
        eos="<|return|>",
        last_end_of_turn="<|return|>",
    ),
}

SYSTEM = {"role": "system", "content": "Be nice."}
TURNS = [
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "Once upon a time, there was a cat."},
    {"role": "user", "content": "What was its name?"},
    {"role": "assistant", "content": "Its name was Tom."},
    {"role": "user", "content": "And the dog?"},
    {"role": "assistant", "content": "The dog was called Max."},
]
REASONING = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "<think>\nTwo and two make four.\n</think>\n\nIt is 4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "<think>\nThree and three make six.\n</think>\n\nIt is 6."},
]
QUOTED = "Its name was Tom."  # a reply that the system prompt, a user turn and an earlier reply all hold


def conversations(chat: Chat) -> dict[str, list[dict]]:
    """The golden cases: with and without a system turn, several replies, a quoted reply, header-like text."""
    quote = [  # every reply is quoted before it: by the system prompt and by the user turn it answers
        {"role": "system", "content": f"When asked for the name, say: {QUOTED}"},
        {"role": "user", "content": f'Repeat after me: "{QUOTED}"'},
        {"role": "assistant", "content": QUOTED},
        {"role": "user", "content": f'You said "{QUOTED}" Say it once more.'},
        {"role": "assistant", "content": QUOTED},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."},
    ]
    header = [
        {"role": "user", "content": "How does a reply start?"},
        {"role": "assistant", "content": f"It starts with {chat.header_like} and then the text."},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": f"Then {chat.header_like}Once upon a time."},
    ]
    return {
        "system_three_replies": [SYSTEM, *TURNS],
        "no_system": TURNS[:4],
        "one_reply": TURNS[:2],
        "quoted_reply": quote,
        "header_like_text": header,
        "reasoning_replies": REASONING,
    }


def chat_tokenizer(base, chat: Chat):
    """The stories260K tokenizer with `chat`'s tokens and template, as the model's tokenizer has them."""
    tok = copy.deepcopy(base)
    tokens = {"additional_special_tokens": sorted({*chat.specials, chat.end_of_turn} - {chat.bos, chat.eos})}
    tokens |= {name: value for name, value in (("bos_token", chat.bos), ("eos_token", chat.eos)) if value}
    tok.add_special_tokens(tokens)
    tok.add_tokens(chat.added)
    tok.chat_template = (TEMPLATES / chat.file).read_text(encoding="utf-8")
    return tok


@pytest.fixture(scope="module")
def base_tokenizer(target_cfg):
    return load_tokenizer(target_cfg)


@pytest.fixture(scope="module", params=sorted(CHATS))
def chat(request, base_tokenizer) -> tuple[Chat, object]:
    spec = CHATS[request.param]
    return spec, chat_tokenizer(base_tokenizer, spec)


def expected_runs(chat: Chat, messages: list[dict]) -> list[str]:
    """Each reply (its answer where the template drops its reasoning) + its end-of-turn token."""
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    runs = []
    for k, (i, m) in enumerate((i, m) for i, m in enumerate(messages) if m["role"] == "assistant"):
        reply = m["content"]
        keeps_reasoning = chat.reasoning == "verbatim" or (chat.reasoning == "last" and i > last_user)
        if "</think>" in reply and not keeps_reasoning:
            reply = reply.split("</think>")[-1].lstrip()
        last = k == len(replies) - 1
        runs.append(reply + (chat.last_end_of_turn if last and chat.last_end_of_turn else chat.end_of_turn))
    return runs


def as_decoded(tok, texts: list[str]) -> list[str]:
    """`texts` as this tokenizer decodes them: stories260K's SentencePiece decoder writes the "▁" in
    DeepSeek's tokens as a space and a space after an added token such as `<think>`."""
    return [tok.decode(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


def dataset(rows: list[tuple[str, list[dict]]]) -> datasets.Dataset:
    return datasets.Dataset.from_list([{"id": i, "messages": m} for i, m in rows])


def template_ids(tok, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "case",
    [
        "system_three_replies",
        "no_system",
        "one_reply",
        "quoted_reply",
        "header_like_text",
        "reasoning_replies",
    ],
)
def test_mask_is_exactly_the_replies_on_the_published_template(chat, case):
    spec, tok = chat
    messages = conversations(spec)[case]
    renderer = ChatRenderer(tok, TargetConfig(chat_template="plain"))
    assert renderer.template_name == "hf"
    rendered = renderer.render(messages)
    assert rendered.input_ids == template_ids(tok, messages)
    assert masked_runs(tok, rendered.input_ids, rendered.loss_mask) == as_decoded(
        tok, expected_runs(spec, messages)
    )


def test_generation_prompt_is_the_templates_own(chat):
    spec, tok = chat
    renderer = ChatRenderer(tok, TargetConfig())
    for messages in conversations(spec).values():
        prompt = messages[:-1]
        assert renderer.render_prompt(prompt) == template_ids(tok, prompt, generation_prompt=True)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1", "deepseek_r1_distill_qwen_32b"])
def test_reasoning_is_trained_only_where_the_template_renders_it(base_tokenizer, name):
    spec = CHATS[name]
    tok = chat_tokenizer(base_tokenizer, spec)
    renderer = ChatRenderer(tok, TargetConfig())
    rendered = renderer.render(REASONING)
    assert rendered.input_ids == template_ids(tok, REASONING)
    runs = masked_runs(tok, rendered.input_ids, rendered.loss_mask)
    assert runs == as_decoded(tok, expected_runs(spec, REASONING))
    if name == "qwen3":  # the last reply keeps its reasoning, the earlier one loses it
        last = "<think>\nThree and three make six.\n</think>\n\nIt is 6.<|im_end|>"
        assert runs == as_decoded(tok, ["It is 4.<|im_end|>", last])
    _, report = tokenize_conversations(dataset([("reasoning", REASONING)]), renderer)
    assert report.fixes == {"reasoning_not_rendered": 1} and report.counts == {}


def test_qwen3_inserted_empty_think_block_is_not_trained(base_tokenizer):
    tok = chat_tokenizer(base_tokenizer, CHATS["qwen3"])
    text = tok.apply_chat_template(TURNS[:4], tokenize=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nIts name was Tom.<|im_end|>\n")
    rendered = ChatRenderer(tok, TargetConfig()).render(TURNS[:4])
    # the last reply is masked as the earlier one is: its text and <|im_end|>, not the inserted block
    assert masked_runs(tok, rendered.input_ids, rendered.loss_mask) == as_decoded(
        tok, ["Once upon a time, there was a cat.<|im_end|>", "Its name was Tom.<|im_end|>"]
    )


def test_a_template_that_rewrites_earlier_turns_does_not_stop_the_dataset(base_tokenizer):
    tok = chat_tokenizer(base_tokenizer, CHATS["qwen3"])
    renderer = ChatRenderer(tok, TargetConfig())
    rows = [("plain", TURNS[:4]), ("reasoning", REASONING), ("plain_2", TURNS[:2])]
    out, report = tokenize_conversations(dataset(rows), renderer)
    assert out["id"] == ["plain", "reasoning", "plain_2"]
    assert report.counts == {} and report.fixes == {"reasoning_not_rendered": 1}
    row = out[1]
    assert masked_runs(tok, row["input_ids"], row["loss_mask"]) == as_decoded(
        tok, expected_runs(CHATS["qwen3"], REASONING)
    )


def test_conversations_the_template_rejects_are_counted_and_skipped(base_tokenizer):
    tok = chat_tokenizer(base_tokenizer, CHATS["mistral_7b_instruct_v0_3"])
    renderer = ChatRenderer(tok, TargetConfig())
    # Mistral's template accepts only a user turn first after the system prompt
    rows = [("ok", TURNS[:2]), ("starts_with_reply", TURNS[1:4]), ("ok_2", TURNS[:4])]
    out, report = tokenize_conversations(dataset(rows), renderer)
    assert out["id"] == ["ok", "ok_2"]
    assert report.counts == {"template_error": 1} and report.seen == 3 and report.kept == 2
