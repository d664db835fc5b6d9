"""Conversations -> token ids and the assistant loss mask.

One method for both kinds of template: render the conversation as text segments, each flagged whether
it lies in an assistant reply (the reply plus its end-of-turn token, never the header), then tokenise
the whole text once with character offsets and mark the tokens that overlap a reply span. Tokenising
the whole text (not segment by segment) gives exactly the ids the model sees at inference time.

- Tokenizer with a chat template (and `target.force_template` false): `tokenizer.apply_chat_template`.
  A reply's span starts where the rendering of the turns before it plus the generation prompt ends,
  and ends where the rendering up to and including the reply ends (trailing whitespace after the
  end-of-turn token excluded). If a template is not prefix-stable (it rewrites earlier turns), the
  reply text is searched for instead and the special token right after it is included.
- Otherwise the fallback template named by `target.chat_template` (eagle_train.data.templates).
Slow tokenizers (no offsets) are tokenised segment by segment.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import datasets

from eagle_train.config.target import TargetConfig
from eagle_train.data.sharegpt import DataError, DropReport
from eagle_train.data.templates import TEMPLATES, Segment, get_template, render_segments

Tokenizer = Any  # a Hugging Face (fast or slow) tokenizer; only modeling/* imports transformers
# tokenizer.model_max_length above this is the "no limit" sentinel, not a real limit
NO_LIMIT = 10**9


@dataclass
class Rendered:
    """One tokenised conversation."""

    input_ids: list[int]
    loss_mask: list[int]  # 1 exactly on assistant reply tokens (+ their end-of-turn token), 0 elsewhere
    truncated: int = 0  # tokens cut off by max_len


class ChatRenderer:
    """Renders conversations for one target: its tokenizer, chat template and maximum length."""

    def __init__(self, tokenizer: Tokenizer, target_cfg: TargetConfig, max_len: int | None = None):
        self.tokenizer = tokenizer
        self.system_prompt = target_cfg.system_prompt
        self.max_len = max_len or target_cfg.max_len or default_max_len(tokenizer)
        has_own = bool(getattr(tokenizer, "chat_template", None))
        if has_own and not target_cfg.force_template:
            self.template_name, self.template = "hf", None
        elif target_cfg.chat_template is not None:
            self.template = get_template(target_cfg.chat_template)
            self.template_name = self.template.name
        else:
            why = "target.force_template is true" if has_own else "its tokenizer has no chat template"
            raise ValueError(
                f"target {target_cfg.name!r} ({target_cfg.path}): {why} and target.chat_template is null; "
                f"set target.chat_template to one of: {', '.join(sorted(TEMPLATES))}"
            )
        self.special_tokens = sorted(set(tokenizer.all_special_tokens), key=len, reverse=True)

    def with_system(self, messages: list[dict]) -> list[dict]:
        """Messages with the target's default system prompt first, unless they carry their own."""
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if self.system_prompt and (not messages or messages[0]["role"] != "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def segments(self, messages: list[dict], generation_prompt: bool = False) -> list[Segment]:
        """Text segments flagged True inside assistant replies (system prompt added)."""
        messages = self.with_system(messages)
        if self.template is None:
            return self.hf_segments(messages, generation_prompt)
        bos, eos = self.tokenizer.bos_token or "", self.tokenizer.eos_token or ""
        return render_segments(self.template, messages, bos, eos, generation_prompt)

    def render(self, messages: list[dict]) -> Rendered:
        """Token ids and loss mask of a conversation, truncated to max_len."""
        return self.truncate(*self.tokenize(self.segments(messages)))

    def truncate(self, ids: list[int], mask: list[int]) -> Rendered:
        """Cut ids and mask to max_len, recording how many tokens were cut."""
        return Rendered(ids[: self.max_len], mask[: self.max_len], max(0, len(ids) - self.max_len))

    def render_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` (ending in a user turn) up to and including the next assistant header:
        the prompt a model continues to write the reply. Not truncated."""
        if messages and messages[-1]["role"] == "assistant":
            raise ValueError(
                "render_prompt needs messages that end in a user turn, got an assistant turn last"
            )
        ids, _ = self.tokenize(self.segments(messages, generation_prompt=True))
        return ids

    def hf_segments(self, messages: list[dict], generation_prompt: bool) -> list[Segment]:
        """Segments from the tokenizer's own template (see the module docstring)."""
        full = self.apply(messages, generation_prompt)
        spans: list[tuple[int, int]] = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            cursor = spans[-1][1] if spans else 0
            before, upto = self.apply(messages[:i], True), self.apply(messages[: i + 1], False)
            if full.startswith(upto) and upto.startswith(before) and len(before) >= cursor:
                spans.append((len(before), len(upto.rstrip())))
            else:
                spans.append(self.search_span(full, m["content"], cursor))
        return cut_segments(full, spans)

    def apply(self, messages: list[dict], generation_prompt: bool) -> str:
        """The tokenizer's chat template as text."""
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def search_span(self, full: str, content: str, cursor: int) -> tuple[int, int]:
        """The span of a reply found by text search after `cursor`, plus the special token that ends it."""
        for candidate in (content, content.strip()):
            start = full.find(candidate, cursor) if candidate else -1
            if start >= 0:
                end = start + len(candidate)
                if self.special_tokens:
                    pattern = r"\s*(?:" + "|".join(map(re.escape, self.special_tokens)) + ")"
                    match = re.match(pattern, full[end:])
                    end += match.end() if match else 0
                return start, end
        raise ValueError(f"the chat template's text does not contain the assistant reply {content[:60]!r}")

    def tokenize(self, segments: list[Segment]) -> tuple[list[int], list[int]]:
        """Token ids and the mask of tokens overlapping a reply segment."""
        return self.tokenize_many([segments])[0]

    def tokenize_many(self, batch: list[list[Segment]]) -> list[tuple[list[int], list[int]]]:
        """`tokenize` for many conversations with one (parallel) tokenizer call."""
        if not self.tokenizer.is_fast:
            return [tokenize_by_segment(self.tokenizer, segments) for segments in batch]
        texts = ["".join(text for text, _ in segments) for segments in batch]
        enc = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return [
            (list(ids), overlap_mask(offsets, reply_spans(segments)))
            for ids, offsets, segments in zip(enc["input_ids"], enc["offset_mapping"], batch, strict=True)
        ]


def reply_spans(segments: list[Segment]) -> list[tuple[int, int]]:
    """Character spans [start, end) of the reply segments in the joined text."""
    spans, pos = [], 0
    for text, is_reply in segments:
        if is_reply:
            spans.append((pos, pos + len(text)))
        pos += len(text)
    return spans


def overlap_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose (non-empty) character range overlaps a span; offsets and spans ascending."""
    mask, k = [], 0
    for start, end in offsets:
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        mask.append(int(end > start and k < len(spans) and spans[k][0] < end))
    return mask


def default_max_len(tokenizer: Tokenizer) -> int:
    """The tokenizer's model_max_length, or no limit when it holds the 'unset' sentinel."""
    limit = int(getattr(tokenizer, "model_max_length", NO_LIMIT) or NO_LIMIT)
    return limit if limit < NO_LIMIT else NO_LIMIT


def cut_segments(text: str, spans: list[tuple[int, int]]) -> list[Segment]:
    """Split `text` at the (sorted, disjoint) reply spans into flagged segments."""
    segments, pos = [], 0
    for a, b in spans:
        segments += [(text[pos:a], False), (text[a:b], True)]
        pos = b
    segments.append((text[pos:], False))
    return [(t, r) for t, r in segments if t]


def tokenize_by_segment(tokenizer: Tokenizer, segments: list[Segment]) -> tuple[list[int], list[int]]:
    """Tokenise each segment on its own (for tokenizers without offsets)."""
    ids: list[int] = []
    mask: list[int] = []
    for text, is_reply in segments:
        piece = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        ids += piece
        mask += [int(is_reply)] * len(piece)
    return ids, mask


def tokenize_conversations(
    ds: datasets.Dataset, renderer: ChatRenderer, num_proc: int | None = None
) -> tuple[datasets.Dataset, DropReport]:
    """Render every conversation of a Dataset (`id`, `messages`) with `datasets.map`.

    Output columns: id, input_ids, loss_mask, num_tokens, num_assistant_tokens. Rows that keep no
    assistant token are dropped and counted (`no_assistant_tokens_after_truncation` when truncation
    removed them, else `no_assistant_tokens`).
    """

    def render_rows(batch: dict[str, list]) -> dict[str, list]:
        segments = []
        for conversation_id, messages in zip(batch["id"], batch["messages"], strict=True):
            try:
                segments.append(renderer.segments(messages))
            except Exception as e:  # a template that rejects a conversation: name it
                raise DataError(f"conversation {conversation_id!r}: cannot render it: {e}") from e
        rendered = [renderer.truncate(ids, mask) for ids, mask in renderer.tokenize_many(segments)]
        n_reply = [sum(r.loss_mask) for r in rendered]
        return {
            "id": batch["id"],
            "input_ids": [r.input_ids for r in rendered],
            "loss_mask": [r.loss_mask for r in rendered],
            "num_tokens": [len(r.input_ids) for r in rendered],
            "num_assistant_tokens": n_reply,
            "drop_reason": [drop_reason(n, r.truncated) for n, r in zip(n_reply, rendered, strict=True)],
        }

    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
            "num_tokens": datasets.Value("int32"),
            "num_assistant_tokens": datasets.Value("int32"),
            "drop_reason": datasets.Value("string"),
        }
    )
    out = ds.map(
        render_rows,
        batched=True,
        batch_size=256,
        remove_columns=ds.column_names,
        features=features,
        num_proc=num_proc,
        desc="tokenize",
    )
    report = DropReport(seen=len(out))
    for reason, n in Counter(out["drop_reason"]).items():
        if reason:
            report.drop(reason, n)
    if report.total:
        out = out.filter(lambda reason: reason == "", input_columns="drop_reason")
    return out.remove_columns("drop_reason"), report


def drop_reason(num_assistant_tokens: int, truncated: int) -> str:
    """Why a rendered conversation is dropped ("" = kept)."""
    if num_assistant_tokens:
        return ""
    return "no_assistant_tokens_after_truncation" if truncated else "no_assistant_tokens"
