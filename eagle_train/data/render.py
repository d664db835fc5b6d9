"""Conversations -> token ids and the assistant loss mask.

One method for both kinds of template: render the conversation as text segments, each flagged whether
it lies in an assistant reply (the reply plus its end-of-turn token, never the header), then tokenise
the whole text once with character offsets and mark the tokens that overlap a reply span. Tokenising
the whole text (not segment by segment) gives exactly the ids the model sees at inference time.

- Tokenizer with a chat template (and `target.force_template` false): `tokenizer.apply_chat_template`.
  The replies are found by rendering the conversation a second time with markers written into every
  reply (eagle_train.data.reply_markers), never by searching for their text, so a user turn that quotes a
  reply, a system prompt that holds it or a reply with header-like text is masked right, and a
  template that moves text between turns (Mistral puts the system prompt into the last user turn)
  costs nothing: two renders per conversation, whatever its length.
- Otherwise the fallback template named by `target.chat_template` (eagle_train.data.templates).
Slow tokenizers (no offsets) are tokenised segment by segment.

Policy for what is trained, in the drop/repair report like every other data policy:
- The mask covers each reply's text (without whitespace around it) and the end-of-turn token right
  after it. Text the template inserts is never trained: headers, Mistral's space before a reply,
  Qwen3's empty `<think>\n\n</think>\n\n` block before the last reply when it has no reasoning.
- Replies with reasoning (`<think>...</think>answer`, as DeepSeek-R1 and Qwen3 write them): trained
  whole, reasoning included, where the template renders them verbatim (Qwen3's last turns, written as
  Qwen3 writes them: `<think>\nreasoning\n</think>\n\nanswer`). Where it renders the answer but not
  the reasoning (Qwen3 before the last user turn, DeepSeek-R1 everywhere, or reasoning the template
  reformats), only the answer is trained and the conversation is counted as fixed
  `reasoning_not_rendered`: the model never sees that reasoning, so it cannot learn it there.
- A conversation the template cannot render exactly is dropped and counted: `template_error` (the
  template raises, e.g. roles that do not alternate), `template_not_exact` (its text depends on a
  reply's text beyond copying it) or `reply_not_rendered` (a reply missing, repeated or rewritten).
  The rest of the dataset goes on; only when the template renders no conversation at all does
  `tokenize_conversations` stop, naming the first one and why.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np

from eagle_train.config.target import TargetConfig
from eagle_train.data.reply_markers import RenderError, locate_replies
from eagle_train.data.sharegpt import DataError, DropReport
from eagle_train.data.templates import TEMPLATES, Segment, get_template, render_segments
from eagle_train.runtime.errors import InputError

Tokenizer = Any  # a Hugging Face (fast or slow) tokenizer; only modeling/* imports transformers
# tokenizer.model_max_length above this is the "no limit" sentinel, not a real limit
NO_LIMIT = 10**9


@dataclass
class Rendered:
    """One tokenised conversation."""

    input_ids: list[int]
    loss_mask: list[int]  # 1 exactly on assistant reply tokens (+ their end-of-turn token), 0 elsewhere
    truncated: int = 0  # tokens cut off by max_len


@dataclass
class Layout:
    """A conversation as text segments flagged True inside replies, and what rendering repaired."""

    segments: list[Segment]
    repairs: list[str] = field(default_factory=list)  # DropReport fix kinds (module docstring)


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
            try:
                self.template = get_template(target_cfg.chat_template)
            except ValueError as err:
                raise InputError(f"target.chat_template={target_cfg.chat_template}: {err}") from None
            self.template_name = self.template.name
        else:
            why = "target.force_template is true" if has_own else "its tokenizer has no chat template"
            raise InputError(
                f"target {target_cfg.name!r} ({target_cfg.path}): {why} and target.chat_template is null; "
                f"set target.chat_template to one of: {', '.join(sorted(TEMPLATES))}"
            )
        # tokens that can end a turn: the special and added special tokens (e.g. <|im_end|>, <|eot_id|>)
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        self.end_tokens = sorted(set(tokenizer.all_special_tokens) | {t.content for t in added if t.special})

    def with_system(self, messages: list[dict]) -> list[dict]:
        """Messages with the target's default system prompt first, unless they carry their own."""
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if self.system_prompt and (not messages or messages[0]["role"] != "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def layout(self, messages: list[dict], generation_prompt: bool = False) -> Layout:
        """Text segments flagged True inside assistant replies (system prompt added), and the repairs made;
        RenderError for a conversation the template cannot render exactly. With `generation_prompt`,
        the text ends with the next reply's header (`messages` should end in a user turn)."""
        messages = self.with_system(messages)
        if self.template is not None:
            bos, eos = self.tokenizer.bos_token or "", self.tokenizer.eos_token or ""
            return Layout(render_segments(self.template, messages, bos, eos, generation_prompt))
        if generation_prompt:  # a prompt: its ids are all that is needed
            return Layout([(self.apply(messages, True), False)])
        located = locate_replies(lambda m: self.apply(m, False), messages, self.end_tokens)
        return Layout(cut_segments(located.text, located.spans), located.repairs)

    def segments(self, messages: list[dict], generation_prompt: bool = False) -> list[Segment]:
        """The segments of `layout`."""
        return self.layout(messages, generation_prompt).segments

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

    def apply(self, messages: list[dict], generation_prompt: bool) -> str:
        """The tokenizer's chat template as text."""
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def tokenize(self, segments: list[Segment]) -> tuple[list[int], list[int]]:
        """Token ids and the mask of tokens overlapping a reply segment."""
        return self.tokenize_many([segments])[0]

    @functools.cached_property
    def char_budget(self) -> int | None:
        """The characters of text that can hold `max_len` tokens, twice over: no token is longer than the
        vocabulary's longest entry (as written in the vocabulary, which is never shorter than its text),
        and the factor 2 keeps the cut away from the last kept token's word. None: no length limit."""
        if self.max_len >= NO_LIMIT:
            return None
        longest = max((len(token) for token in self.tokenizer.get_vocab()), default=1)
        return 2 * self.max_len * max(longest, 1)

    def tokenize_many(self, batch: list[list[Segment]]) -> list[tuple[list[int], list[int]]]:
        """`tokenize` for many conversations with one (parallel) tokenizer call. Text beyond
        `char_budget` is cut before tokenizing (it lies past max_len tokens, which `truncate` keeps), so
        a 20 MB message costs no more than max_len tokens' worth of text."""
        batch = [cut_to_budget(segments, self.char_budget) for segments in batch]
        if not self.tokenizer.is_fast:
            return [tokenize_by_segment(self.tokenizer, segments) for segments in batch]
        texts = ["".join(text for text, _ in segments) for segments in batch]
        enc = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return [
            (list(ids), overlap_mask(offsets, reply_spans(segments)))
            for ids, offsets, segments in zip(enc["input_ids"], enc["offset_mapping"], batch, strict=True)
        ]


def cut_to_budget(segments: list[Segment], budget: int | None) -> list[Segment]:
    """The segments cut after `budget` characters in all (None: unchanged)."""
    if budget is None or sum(len(text) for text, _ in segments) <= budget:
        return segments
    out, left = [], budget
    for text, is_reply in segments:
        if left <= 0:
            break
        out.append((text[:left], is_reply))
        left -= len(text)
    return out


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


def render_rows(renderer: ChatRenderer, ids: list[str], conversations: list[list[dict]]) -> dict[str, list]:
    """Render and tokenise a batch of conversations (one tokenizer call). Columns: id, input_ids,
    loss_mask, num_tokens, num_assistant_tokens, drop_reason ("" = kept), drop_detail, repairs."""
    layouts, failures = [], []
    for conversation_id, messages in zip(ids, conversations, strict=True):
        try:
            layouts.append(renderer.layout(messages))
            failures.append(("", ""))
        except RenderError as e:  # counted and skipped; named if no conversation renders
            layouts.append(Layout([]))
            failures.append((e.reason, f"conversation {conversation_id!r}: cannot render it: {e}"))
    tokenized = renderer.tokenize_many([layout.segments for layout in layouts])
    rendered = [renderer.truncate(ids_, mask) for ids_, mask in tokenized]
    n_reply = [sum(r.loss_mask) for r in rendered]
    return {
        "id": list(ids),
        "input_ids": [r.input_ids for r in rendered],
        "loss_mask": [r.loss_mask for r in rendered],
        "num_tokens": [len(r.input_ids) for r in rendered],
        "num_assistant_tokens": n_reply,
        "drop_reason": [
            failed or drop_reason(n, r.truncated)
            for (failed, _), n, r in zip(failures, n_reply, rendered, strict=True)
        ],
        "drop_detail": [detail for _, detail in failures],
        "repairs": [",".join(layout.repairs) for layout in layouts],
    }


def tokenize_conversations(
    ds: datasets.Dataset, renderer: ChatRenderer, num_proc: int | None = None
) -> tuple[datasets.Dataset, DropReport]:
    """Render every conversation of a Dataset (`id`, `messages`) with `datasets.map` (`render_rows`).

    Output columns: id, input_ids, loss_mask, num_tokens, num_assistant_tokens. Dropped and counted:
    conversations the template cannot render exactly (by RenderError reason) and rows that keep no
    assistant token (`no_assistant_tokens_after_truncation` when truncation removed them, else
    `no_assistant_tokens`); repairs are counted as fixes. DataError when the template renders none.
    """
    text = datasets.Value("string")
    features = datasets.Features(
        {
            "id": text,
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
            "num_tokens": datasets.Value("int32"),
            "num_assistant_tokens": datasets.Value("int32"),
            "drop_reason": text,
            "drop_detail": text,
            "repairs": text,
        }
    )
    out = ds.map(
        lambda batch: render_rows(renderer, batch["id"], batch["messages"]),
        batched=True,
        batch_size=256,
        remove_columns=ds.column_names,
        features=features,
        num_proc=num_proc,
        desc="tokenize",
    )
    report = tokenize_report(out)
    if report.total:
        out = out.filter(lambda reason: reason == "", input_columns="drop_reason")
    return out.remove_columns(["drop_reason", "drop_detail", "repairs"]), report


def tokenize_stream(
    conversations: Iterable[dict], renderer: ChatRenderer, report: DropReport, batch_size: int = 256
) -> Iterator[dict[str, Any]]:
    """`tokenize_conversations` as a stream: the kept rows {"id", "input_ids" int32 [L], "loss_mask"
    uint8 [L]} in order, `batch_size` conversations rendered per tokenizer call (memory: one batch).
    Drops and repairs are counted in `report` (as drops of the conversations `report` has seen); the
    DataError for a template that renders none is raised at the end."""
    kept, first_failure = 0, ""
    source = iter(conversations)
    while batch := list(itertools.islice(source, batch_size)):
        rows = render_rows(renderer, [c["id"] for c in batch], [c["messages"] for c in batch])
        for k, reason in enumerate(rows["drop_reason"]):
            for kind in filter(None, rows["repairs"][k].split(",")):
                report.fix(kind)
            first_failure = first_failure or rows["drop_detail"][k]
            if reason:
                report.drop(reason)
                continue
            kept += 1
            yield {
                "id": rows["id"][k],
                "input_ids": np.asarray(rows["input_ids"][k], dtype=np.int32),
                "loss_mask": np.asarray(rows["loss_mask"][k], dtype=np.uint8),
            }
    if first_failure and not kept:
        raise DataError(f"the chat template renders no conversation ({report.format()}); {first_failure}")


def tokenize_report(out: datasets.Dataset) -> DropReport:
    """Drops and repairs of a tokenized Dataset; DataError when no conversation could be rendered."""
    report = DropReport(seen=len(out))
    for reason, n in Counter(out["drop_reason"]).items():
        if reason:
            report.drop(reason, n)
    for repairs, n in Counter(out["repairs"]).items():
        for kind in filter(None, repairs.split(",")):
            report.fix(kind, n)
    if report.seen and not report.kept and any(out["drop_detail"]):
        first = next(detail for detail in out["drop_detail"] if detail)
        raise DataError(f"the chat template renders no conversation ({report.format()}); {first}")
    return report


def drop_reason(num_assistant_tokens: int, truncated: int) -> str:
    """Why a rendered conversation is dropped ("" = kept)."""
    if num_assistant_tokens:
        return ""
    return "no_assistant_tokens_after_truncation" if truncated else "no_assistant_tokens"
