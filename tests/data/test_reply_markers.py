"""Locating replies by marked rendering: every way a template can fail to render a reply exactly is caught."""

from __future__ import annotations

import pytest

from eagle_train.data.reply_markers import MARKER_PAIRS, RenderError, locate_replies, reasoning_end

CONV = [
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "  hi  "},
    {"role": "user", "content": "Again, hi."},
    {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nhi"},
]


def chatml(messages: list[dict], reply=lambda m: m["content"]) -> str:
    """A ChatML rendering in plain Python, with `reply` deciding what an assistant turn shows."""
    turns = [(m["role"], reply(m) if m["role"] == "assistant" else m["content"]) for m in messages]
    return "".join(f"<s>{role}\n{text}</s>\n" for role, text in turns)


def spans_text(located) -> list[str]:
    return [located.text[a:b] for a, b in located.spans]


def test_replies_are_found_where_the_template_puts_them_not_where_their_text_first_occurs():
    located = locate_replies(chatml, CONV, ["</s>"])
    assert located.text == chatml(CONV)
    # "hi" occurs first in the user turns; the spans are the replies, trimmed, with their end of turn
    assert spans_text(located) == ["hi  </s>", "<think>\nEasy.\n</think>\n\nhi</s>"]
    assert located.repairs == []


def test_dropped_reasoning_keeps_the_answer_and_is_reported():
    def drop_reasoning(m):
        return m["content"].split("</think>")[-1].lstrip()

    located = locate_replies(lambda ms: chatml(ms, drop_reasoning), CONV, ["</s>"])
    assert spans_text(located) == ["hi  </s>", "hi</s>"]
    assert located.repairs == ["reasoning_not_rendered"]


@pytest.mark.parametrize(
    "reply, reason",
    [
        (lambda m: m["content"] + " / " + m["content"], "reply_not_rendered"),  # rendered twice
        (lambda m: "", "reply_not_rendered"),  # not rendered
        (lambda m: m["content"].replace("hi", "hello"), "reply_not_rendered"),  # rewritten
        (lambda m: f"({len(m['content'])} chars) " + m["content"], "template_not_exact"),  # depends on it
        (lambda m: m["content"][:-2], "template_not_exact"),  # cuts a marker apart
    ],
)
def test_a_reply_the_template_does_not_copy_exactly_is_refused(reply, reason):
    with pytest.raises(RenderError) as error:
        locate_replies(lambda ms: chatml(ms, reply), CONV, ["</s>"])
    assert error.value.reason == reason


def test_a_template_that_raises_is_a_template_error():
    def reject(messages):
        raise ValueError("roles must alternate")

    with pytest.raises(RenderError, match="roles must alternate") as error:
        locate_replies(reject, CONV, ["</s>"])
    assert error.value.reason == "template_error"


def test_marker_characters_in_the_conversation_are_avoided():
    taken = "".join(MARKER_PAIRS[0]) + MARKER_PAIRS[1][0]
    conv = [{"role": "user", "content": f"odd {taken}"}, {"role": "assistant", "content": f"odd {taken} too"}]
    located = locate_replies(chatml, conv, ["</s>"])
    assert spans_text(located) == [f"odd {taken} too</s>"]


def test_reasoning_end_is_after_the_last_think_block_and_its_whitespace():
    assert reasoning_end("no reasoning") == 0
    assert reasoning_end("<think>a</think>\n\nb") == len("<think>a</think>\n\n")
    assert reasoning_end("<think>a</think>b<think>c</think> d") == len("<think>a</think>b<think>c</think> ")
