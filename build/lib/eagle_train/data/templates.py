"""Fallback chat templates, by name, for tokenizers that ship no chat template of their own.

A template turns messages into text segments, each flagged whether it belongs to an assistant reply
(the loss-masked span: the reply and its end-of-turn token, never the assistant header). Spellings
follow the formats' own sources: FastChat's `vicuna_v1.1` (`USER: ... ASSISTANT: ...</s>`), Meta's
Llama-2 chat (`<s>[INST] <<SYS>>...<</SYS>> ... [/INST] ... </s>`), Meta's Llama-3 header/`<|eot_id|>`
format, ChatML (`<|im_start|>role\\n...<|im_end|>\\n`, Qwen) and `plain` (BOS, then the turns' text
joined by single spaces, no role markers, no end-of-turn token: TinyStories for stories260K).
In the format strings `{bos}`/`{eos}` are the tokenizer's BOS/EOS text and `{content}` the message.
"""

from __future__ import annotations

from dataclasses import dataclass

Segment = tuple[str, bool]  # (text, is part of an assistant reply)


@dataclass(frozen=True)
class ChatTemplate:
    """A chat format as format strings; see `render_segments` for how they are put together."""

    name: str
    begin: str = ""  # once, at the very start
    system: str = "{content}"  # a system message
    user: str = "{content}"  # a user message
    assistant_header: str = ""  # before a reply, outside the mask; a generation prompt ends with it
    assistant: str = "{content}"  # the reply and its end-of-turn token: the loss-masked span
    assistant_suffix: str = ""  # after the end-of-turn, outside the mask (ChatML's newline)
    join: str = ""  # opens every turn but the first (inside the span for a reply: it joins the first word)
    system_in_first_user: bool = False  # the system block opens the first user message (Llama-2)
    strip: bool = False  # strip whitespace around message contents (as Meta's templates do)


TEMPLATES: dict[str, ChatTemplate] = {
    t.name: t
    for t in (
        ChatTemplate(name="plain", begin="{bos}", join=" "),
        ChatTemplate(
            name="vicuna_v1.1",
            begin="{bos}",
            system="{content} ",
            user="USER: {content} ",
            assistant_header="ASSISTANT:",
            assistant=" {content}{eos}",
        ),
        ChatTemplate(
            name="llama2_chat",
            system="<<SYS>>\n{content}\n<</SYS>>\n\n",
            user="{bos}[INST] {content} [/INST]",
            assistant=" {content} {eos}",
            system_in_first_user=True,
            strip=True,
        ),
        ChatTemplate(
            name="llama3",
            begin="<|begin_of_text|>",
            system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
            user="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>",
            assistant_header="<|start_header_id|>assistant<|end_header_id|>\n\n",
            assistant="{content}<|eot_id|>",
            strip=True,
        ),
        ChatTemplate(
            name="chatml",
            system="<|im_start|>system\n{content}<|im_end|>\n",
            user="<|im_start|>user\n{content}<|im_end|>\n",
            assistant_header="<|im_start|>assistant\n",
            assistant="{content}<|im_end|>",
            assistant_suffix="\n",
        ),
    )
}


def get_template(name: str) -> ChatTemplate:
    """The fallback template called `name`; ValueError listing the known names otherwise."""
    if name not in TEMPLATES:
        raise ValueError(
            f"unknown chat template {name!r}; known fallback templates: {', '.join(sorted(TEMPLATES))}"
        )
    return TEMPLATES[name]


def fill(fmt: str, content: str, bos: str, eos: str) -> str:
    """A format string with `{bos}`, `{eos}` and `{content}` filled in (content may hold braces)."""
    head, _, tail = fmt.replace("{bos}", bos).replace("{eos}", eos).partition("{content}")
    return head + content + tail if _ else head


def render_segments(
    template: ChatTemplate,
    messages: list[dict[str, str]],
    bos: str = "",
    eos: str = "",
    generation_prompt: bool = False,
) -> list[Segment]:
    """Messages -> text segments flagged True inside assistant replies.

    With `generation_prompt`, the segments end with the assistant header of the next reply, so the
    text is what a model continues to write that reply (`messages` should end in a user turn).
    """
    segments: list[Segment] = [(fill(template.begin, "", bos, eos), False)]
    system = ""
    first = True
    for m in messages:
        content = m["content"].strip() if template.strip else m["content"]
        join = "" if first else template.join
        if m["role"] == "system" and template.system_in_first_user:
            system += fill(template.system, content, bos, eos)
            continue
        if m["role"] == "assistant":
            segments.append((fill(template.assistant_header, "", bos, eos), False))
            segments.append((join + fill(template.assistant, content, bos, eos), True))
            segments.append((fill(template.assistant_suffix, "", bos, eos), False))
        else:
            fmt = template.system if m["role"] == "system" else template.user
            segments.append(
                (join + fill(fmt, system + content if m["role"] == "user" else content, bos, eos), False)
            )
            system = "" if m["role"] == "user" else system
        first = False
    if generation_prompt:
        segments.append((fill(template.assistant_header, "", bos, eos), False))
    return [(text, is_reply) for text, is_reply in segments if text]
