"""Where each assistant reply lies in a chat template's rendering, found without searching for text.

The template renders the conversation twice: as it is, and with two markers written into every reply
(private-use characters that occur nowhere in the conversation): one where the reply's answer begins
(after its `<think>...</think>` block, if it has one) and one where the reply ends. A template copies
the markers like any other reply text, so removing them from the second rendering must give back the
first one exactly, and their positions are then the positions of the reply in the real rendering.
Nothing is searched for: a user turn or a system prompt that quotes a reply, or a reply that holds
header-like text, cannot be mistaken for it. The reply's span is then

- the whole reply (its text without surrounding whitespace) when the template renders it verbatim,
  ending at the end marker; text the template adds around it (an assistant header, Qwen3's empty
  `<think>\\n\\n</think>\\n\\n` block before a reply without reasoning, Mistral's space) stays outside;
- only its answer, from the answer marker, when the template renders the answer verbatim but not the
  reasoning before it (Qwen3 drops `<think>` blocks from turns before the last user turn, DeepSeek-R1
  from every turn): repaired, counted as `reasoning_not_rendered`;
- otherwise nothing: the conversation cannot be rendered exactly (see `RenderError`).

Each span is then extended over the end-of-turn token: whitespace and one special token right after
the reply (`<|im_end|>`, `<|eot_id|>`, `</s>`, `<|end|>`, `<|return|>`, ...).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from eagle_train.runtime.errors import InputError

REASONING_CLOSE = "</think>"  # the tag that ends a reply's reasoning block (Qwen3, DeepSeek-R1, QwQ, ...)
REPAIR_REASONING = "reasoning_not_rendered"  # DropReport fix: a reply's reasoning is not in the rendering
# Candidate marker delimiters: pairs of private-use characters; the first pair absent from the text is used.
MARKER_PAIRS = [(chr(0xE000 + 2 * i), chr(0xE001 + 2 * i)) for i in range(64)]

Render = Callable[[list[dict]], str]  # messages -> the template's text


class RenderError(InputError):
    """A conversation the chat template cannot render exactly. `reason` is its DropReport key:
    `template_error` (the template raised), `template_not_exact` (its output depends on the reply text
    beyond copying it) or `reply_not_rendered` (a reply is missing, repeated or rewritten)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class Reply:
    """One assistant reply as the marked rendering sees it."""

    core: str  # the reply without surrounding whitespace
    answer: str  # the part of `core` after its reasoning block (all of `core` without one)
    marked: str  # the content rendered in the marked pass


@dataclass
class Located:
    """A template's rendering with the span of every reply in it."""

    text: str  # exactly what the template renders for the conversation
    spans: list[tuple[int, int]]  # [start, end) of each reply plus its end-of-turn token, ascending
    repairs: list[str] = field(default_factory=list)  # DropReport fix kinds, each at most once


def locate_replies(render: Render, messages: list[dict], end_tokens: Sequence[str]) -> Located:
    """The rendering of `messages` and the span of each assistant reply in it (module docstring)."""
    text = render_or_raise(render, messages)
    open_, close = marker_pair(messages)
    replies: dict[int, Reply] = {}
    marked_messages = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            replies[k] = mark_reply(m["content"], k, open_, close)
            m = {**m, "content": replies[k].marked}
        marked_messages.append(m)
    plain, positions = strip_markers(render_or_raise(render, marked_messages), open_, close)
    if plain != text:
        raise RenderError(
            "template_not_exact", "the template's text depends on the reply text beyond copying it"
        )
    end_pattern = end_of_turn_pattern(tuple(end_tokens))
    spans, repairs = [], set()
    for k, reply in replies.items():
        start, end, repaired = reply_span(text, reply, positions.get(f"a{k}", []), positions.get(f"e{k}", []))
        if repaired:
            repairs.add(REPAIR_REASONING)
        match = end_pattern.match(text, end) if end_pattern else None
        spans.append((start, match.end() if match else end, k))
    spans.sort()
    for (_, prev_end, j), (start, _, k) in zip(spans, spans[1:], strict=False):
        if start < prev_end:
            raise RenderError("reply_not_rendered", f"replies {j} and {k} overlap in the rendering")
    return Located(text, [(a, b) for a, b, _ in spans], sorted(repairs))


def render_or_raise(render: Render, messages: list[dict]) -> str:
    """`render(messages)`, any exception from the template turned into a RenderError."""
    try:
        return render(messages)
    except Exception as e:  # a template's raise_exception, a Jinja error, a missing field
        raise RenderError("template_error", f"the chat template rejects it: {e}") from e


def marker_pair(messages: list[dict]) -> tuple[str, str]:
    """Two private-use characters that occur in no message of the conversation."""
    used = set("".join(m["content"] for m in messages))
    for open_, close in MARKER_PAIRS:
        if open_ not in used and close not in used:
            return open_, close
    raise RenderError("template_not_exact", "the conversation uses every private-use marker character")


def mark_reply(content: str, k: int, open_: str, close: str) -> Reply:
    """The reply of turn `k` with its answer-start and end markers written in."""
    lead = len(content) - len(content.lstrip())
    core = content[lead : len(content.rstrip())]
    cut = reasoning_end(core)
    marked = (
        content[:lead]
        + core[:cut]
        + f"{open_}a{k}{close}"
        + core[cut:]
        + f"{open_}e{k}{close}"
        + content[lead + len(core) :]
    )
    return Reply(core=core, answer=core[cut:], marked=marked)


def reasoning_end(core: str) -> int:
    """Index in `core` just after its reasoning block (the last `</think>` and the whitespace after it);
    0 when the reply has no reasoning block."""
    tag = core.rfind(REASONING_CLOSE)
    if tag < 0:
        return 0
    end = tag + len(REASONING_CLOSE)
    return end + len(core[end:]) - len(core[end:].lstrip())


def strip_markers(text: str, open_: str, close: str) -> tuple[str, dict[str, list[int]]]:
    """`text` without markers, and each marker's positions in that text."""
    pattern = marker_pattern(open_, close)
    pieces, positions, pos, length = [], {}, 0, 0
    for m in pattern.finditer(text):
        pieces.append(text[pos : m.start()])
        length += m.start() - pos
        positions.setdefault(m.group(1), []).append(length)
        pos = m.end()
    pieces.append(text[pos:])
    plain = "".join(pieces)
    if open_ in plain or close in plain:  # a marker the template cut apart
        raise RenderError("template_not_exact", "the template cut a reply apart")
    return plain, positions


def reply_span(text: str, reply: Reply, answers: list[int], ends: list[int]) -> tuple[int, int, bool]:
    """(start, end, reasoning dropped) of one reply in `text`, from its marker positions."""
    if len(ends) != 1 or len(answers) > 1:
        what = "not rendered" if not ends else "rendered more than once"
        raise RenderError("reply_not_rendered", f"a reply is {what} by the template")
    end = ends[0]
    answer_start = end - len(reply.answer)
    if answers not in ([], [answer_start]) or text[answer_start:end] != reply.answer:
        raise RenderError("reply_not_rendered", "the template rewrites a reply")
    start = end - len(reply.core)
    if start >= 0 and text[start:end] == reply.core:
        return start, end, False
    if answers and reply.answer:
        return answer_start, end, True
    raise RenderError("reply_not_rendered", "the template rewrites a reply")


@lru_cache(maxsize=64)
def marker_pattern(open_: str, close: str) -> re.Pattern:
    """A marker: `open_`, a (answer start) or e (end), the turn's index, `close`."""
    return re.compile(re.escape(open_) + r"([ae]\d+)" + re.escape(close))


@lru_cache(maxsize=16)
def end_of_turn_pattern(end_tokens: tuple[str, ...]) -> re.Pattern | None:
    """Whitespace then one of `end_tokens` (longest first), or None without any."""
    tokens = sorted({t for t in end_tokens if t}, key=len, reverse=True)
    return re.compile(r"\s*(?:" + "|".join(map(re.escape, tokens)) + ")") if tokens else None
