"""The decode-time forward of a few new tokens compiled with the weights frozen in (target.compile_frozen).

On a CPU a small model's forward over a few new tokens is bound by reading its weights once: one plain step of
SmolLM2-135M reads 538 MB. Eager matrix products (oneMKL through `F.linear`) read them at 8-9 GB/s, and more
slowly again for 2 to 8 rows; inductor's C++ GEMM micro-kernels over prepacked, frozen weights read them at
20-25 GB/s for 1 to 4 rows (docs/benchmarks.md, the verify cost curve). `FrozenDecoder` compiles the decoder
and LM head once per padded query count (`QUERY_BUCKETS`) with inductor's freezing and max-autotune (each
matrix product's kernel chosen by timing the candidates), the context length symbolic: a growing cache never
recompiles. A forward of q new tokens is padded to the next bucket: the padding rows repeat the last token,
attend only to themselves, and write their keys and values past the real ones, where nothing is committed
(`pad_queries`); their outputs are dropped. Everything else is the stock model: the same modules, the same
cache (through `SlotCacheView`), the same masks as the eager decode path.

A CPU GEMM kernel that reads each weight once for up to 4 rows may take twice as long or more for 8 (measured on
SmolLM2-135M: 25 ms for 4 new tokens, 103 ms for 8). So a wide forward may run as consecutive chunks of a
smaller bucket, each chunk's keys and values written to the cache before the next attends to them (the same
attention, as a chunked prefill computes it): at the first forward of each bucket wider than `MIN_CHUNK` the
whole graph and every chunking are timed on that forward, and the fastest is kept for the process (`plan`).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from eagle_train.decoding.kv_cache import StaticKVCache
from eagle_train.modeling.attention_layout import additive_mask

QUERY_BUCKETS = (1, 2, 4, 8, 16)  # padded query counts, one graph each
MIN_CHUNK = 4  # the narrowest chunk a wide forward is split into (narrower ones read the weights as often)
PLAN_REPEATS = 2  # timings per candidate when a bucket's chunking is chosen (the fastest of each kept)


def query_bucket(queries: int) -> int | None:
    """The padded query count of a forward of `queries` new tokens (None: wider than every bucket)."""
    return next((b for b in QUERY_BUCKETS if b >= queries), None)


class SlotCacheView:
    """A `StaticKVCache` seen through the Hugging Face `Cache` calls, the context length read off the shape of
    `slots` (a tensor the compiled graph keeps symbolic) rather than the cache's Python int."""

    is_compileable = False

    def __init__(self, cache: StaticKVCache, slots: torch.Tensor):
        self.cache, self.slots = cache, slots

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        end, queries = self.slots.shape[0], key_states.shape[2]
        keys, values = self.cache._layer_keys[layer_idx], self.cache._layer_values[layer_idx]
        keys.narrow(2, end - queries, queries).copy_(key_states)
        values.narrow(2, end - queries, queries).copy_(value_states)
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.slots.shape[0] - 1


def pad_queries(
    input_ids: torch.Tensor,  # [1, q]
    position_ids: torch.Tensor,  # [1, q]
    attention_mask: torch.Tensor,  # bool [1, 1, q, L + q]
    padded: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward padded to `padded` queries: the last token repeated at its position; padding rows attend to
    themselves only and no real row attends to them. Returns ids, positions [1, padded] and the boolean mask
    [1, 1, padded, L + padded]."""
    queries = input_ids.shape[1]
    pad = padded - queries
    if pad == 0:
        return input_ids, position_ids, attention_mask
    context = attention_mask.shape[-1] - queries
    mask = torch.zeros(1, 1, padded, context + padded, dtype=torch.bool, device=attention_mask.device)
    mask[:, :, :queries, : context + queries] = attention_mask
    mask[0, 0, queries:, context + queries :] = torch.eye(pad, dtype=torch.bool, device=mask.device)
    ids = torch.cat([input_ids, input_ids[:, -1:].expand(1, pad)], 1)
    positions = torch.cat([position_ids, position_ids[:, -1:].expand(1, pad)], 1)
    return ids, positions, mask


class FrozenStep(nn.Module):
    """Decoder + LM head (+ the model's logit processing) as one module: what a frozen graph computes. It
    returns every layer's input too (`hidden_states`: computed anyway, and one graph then serves forwards
    with and without EAGLE-3's aux features)."""

    def __init__(self, decoder: nn.Module, lm_head: nn.Module, transform, cache_kwarg: str):
        super().__init__()
        self.decoder, self.lm_head, self.transform, self.cache_kwarg = (
            decoder,
            lm_head,
            transform,
            cache_kwarg,
        )

    def forward(self, input_ids, position_ids, attention_mask, view):
        out = self.decoder(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=True,
            output_hidden_states=True,
            **{self.cache_kwarg: view},
        )
        hidden = out.last_hidden_state
        logits = self.lm_head(hidden)
        logits = logits if self.transform.identity else self.transform(logits)
        return logits, hidden, out.hidden_states


class FrozenDecoder:
    """The compiled `FrozenStep`: torch.compile builds one graph per padded query count, at its first use; a
    forward wider than MIN_CHUNK runs whole or in chunks, as `plan` measured."""

    def __init__(self, decoder, lm_head, transform, cache_kwarg: str, dtype: torch.dtype, cpp_wrapper: bool):
        self.dtype, self.cpp_wrapper = dtype, cpp_wrapper
        self.step = torch.compile(FrozenStep(decoder, lm_head, transform, cache_kwarg), dynamic=False)
        self.chunks: dict[int, int] = {}  # bucket -> the chunk its forwards run in (measured by `plan`)

    def inductor_options(self) -> dict:
        """Inductor's settings while a frozen graph is built (a patch of its global config: torch.compile's
        `options` do not reach freezing and the GEMM autotuning)."""
        return {
            "freezing": True,
            "max_autotune": True,
            "max_autotune_gemm_backends": "CPP,ATEN",
            "cpp_wrapper": self.cpp_wrapper,
        }

    def fits(self, queries: int, cache: StaticKVCache) -> bool:
        """Whether a forward of `queries` new tokens runs here: after the prompt (a cache with committed slots:
        the context length stays a symbol), its bucket exists and the padding fits in the cache."""
        padded = query_bucket(queries)
        return padded is not None and cache.seq_len > 0 and cache.seq_len + padded <= cache.capacity

    def __call__(self, input_ids, position_ids, attention_mask, cache: StaticKVCache):
        """The stock forward of a forward that `fits`: logits [1, q, vocab], the last hidden state [1, q,
        hidden] and Hugging Face's `hidden_states` (each [1, q, hidden]) of the q real tokens."""
        bucket = query_bucket(input_ids.shape[1])
        if bucket not in self.chunks:
            self.chunks[bucket] = self.plan(bucket, input_ids, position_ids, attention_mask, cache)
        return self.forward(self.chunks[bucket], input_ids, position_ids, attention_mask, cache)

    def plan(self, bucket: int, input_ids, position_ids, attention_mask, cache: StaticKVCache) -> int:
        """The chunk (a bucket from MIN_CHUNK up to `bucket`) whose run of this forward was fastest, each
        candidate built and run once, then timed PLAN_REPEATS times (the fastest kept). Nothing is
        committed: each run writes the same keys and values to the same uncommitted slots."""
        candidates = [c for c in QUERY_BUCKETS if MIN_CHUNK <= c <= bucket] or [bucket]
        if len(candidates) == 1:
            return candidates[0]
        seconds = {}
        for chunk in candidates:
            self.forward(chunk, input_ids, position_ids, attention_mask, cache)  # builds its graph
            runs = []
            for _ in range(PLAN_REPEATS):
                start = time.perf_counter()
                self.forward(chunk, input_ids, position_ids, attention_mask, cache)
                runs.append(time.perf_counter() - start)
            seconds[chunk] = min(runs)
        return min(seconds, key=seconds.get)

    def forward(self, chunk: int, input_ids, position_ids, attention_mask, cache: StaticKVCache):
        """The forward in consecutive pieces of at most `chunk` queries (one piece: the whole), each through
        its bucket's graph; a piece attends to the context and the pieces before it (their keys and values
        are in the cache by then) as the whole forward's mask says."""
        queries = input_ids.shape[1]
        context = attention_mask.shape[-1] - queries
        pieces = []
        for lo in range(0, queries, chunk):
            hi = min(lo + chunk, queries)
            mask = attention_mask[:, :, lo:hi, : context + hi]
            pieces.append(self.run(input_ids[:, lo:hi], position_ids[:, lo:hi], mask, cache))
        if len(pieces) == 1:
            return pieces[0]
        logits, hidden, states = zip(*pieces, strict=True)
        return (
            torch.cat(logits, 1),
            torch.cat(hidden, 1),
            tuple(torch.cat(h, 1) for h in zip(*states, strict=True)),
        )

    def run(self, input_ids, position_ids, attention_mask, cache: StaticKVCache):
        """One graph's forward: the queries padded to their bucket, the padding's outputs dropped."""
        import torch._inductor.config as inductor_config

        queries = input_ids.shape[1]
        ids, positions, mask = pad_queries(input_ids, position_ids, attention_mask, query_bucket(queries))
        mask = additive_mask(mask, self.dtype)
        slots = torch.empty(mask.shape[-1], dtype=torch.int8, device=mask.device)  # only its length is read
        torch._dynamo.mark_dynamic(mask, 3)
        torch._dynamo.mark_dynamic(slots, 0)
        for layer in (*cache._layer_keys, *cache._layer_values):  # its capacity: one graph for every cache
            torch._dynamo.mark_dynamic(layer, 2)
        with inductor_config.patch(self.inductor_options()):
            logits, hidden, hidden_states = self.step(ids, positions, mask, SlotCacheView(cache, slots))
        return logits[:, :queries], hidden[:, :queries], tuple(h[:, :queries] for h in hidden_states)
