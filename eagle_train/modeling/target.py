"""The frozen target model behind one adapter.

`load_target` loads any Hugging Face causal LM (local directory or hub id) frozen and in eval mode;
`Target.features` returns the logits and the last hidden state, the LM head's input (EAGLE's feature
f_j); `Target.aux_hidden_states` adds EAGLE-3's features, the inputs of the decoder layers
`Target.aux_layers` concatenated (Hugging Face's `hidden_states[i]` is the input of layer i, pre-norm,
the same as vLLM's and SGLang's aux hidden state i). Only `modeling/*` imports `transformers`.

Decode time (used by `eagle_train.decoding.decoder`): `Target.new_cache` preallocates a `StaticKVCache`;
`Target.decode` runs the stock model on new tokens with explicit position ids and a 4-D boolean
attention mask (True = attend; converted once per forward to an additive float mask) against that
cache, writing the new keys/values after the committed slots. A prefill is `decode` with a causal mask,
a tree verification is `decode` with the tree mask and positions prefix + depth; the caller then keeps
the accepted path with `StaticKVCache.compact`. No patched modeling code: the cache reaches the model
through `HFCacheView`, which speaks the `Cache.update(key, value, layer_idx)` call of the attention layers.
What the model's own mask functions add to causality (sliding windows per layer type) is added to that mask
(`modeling.attention_layout`), and before its first decode-time use a target must pass `check_decode`: a
cached prefill, a tree verification and a plain step on a probe longer than its widest window give the
logits and features of the model's own cache-free forwards, or the target is refused, naming what differs.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers import __version__ as transformers_version

from eagle_train.config.base import resolve_path
from eagle_train.config.target import FLOAT_DTYPES, TargetConfig, resolve_aux_layers
from eagle_train.data.templates import TEMPLATES
from eagle_train.decoding.kv_cache import StaticKVCache
from eagle_train.modeling.attention_layout import (
    AttentionLayout,
    UnsupportedAttention,
    additive_mask,
    attention_implementation,
    attention_layout,
)
from eagle_train.modeling.decode_check import check_decode
from eagle_train.modeling.frozen_step import FrozenDecoder
from eagle_train.modeling.gguf import gguf_model_dir, is_gguf_target
from eagle_train.modeling.logit_transform import LogitTransform
from eagle_train.runtime.errors import InputError

log = logging.getLogger(__name__)
# Attention implementations that take the decoder's 4-D boolean mask (a tree: each node sees the prefix and
# its ancestors). flash_attention_2 reads a 4-D mask as a 2-D padding mask; the rest are not checked.
DECODE_ATTENTION = ("eager", "sdpa")
RECOMPILE_LIMIT = 64  # graphs a compiled decoder may build (`Target._compiled_decoder`)
TORCH_DTYPES = {name: getattr(torch, name) for name in FLOAT_DTYPES}  # config name -> torch dtype
DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}  # and back (config.json)
# Config fields of the logit processing a ForCausalLM applies after its LM head
# (see eagle_train.modeling.logit_transform).
LOGIT_FIELDS = ("final_logit_softcapping", "logits_scaling", "logit_scale", "lm_head_multiplier")


def torch_dtype(name: str) -> torch.dtype:
    """Map a config dtype name to a torch dtype."""
    if name not in TORCH_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def target_source(cfg: TargetConfig) -> str:
    """The path or hub id the target is loaded from (a relative local path is resolved; a GGUF, the
    directory it was converted into: modeling.gguf). A path that cannot be a hub id (`org/name`) and does
    not exist is a FileNotFoundError naming target.path, rather than a hub error about a repository name."""
    if is_gguf_target(cfg):
        return str(gguf_model_dir(cfg))
    local = resolve_path(cfg.path)
    if local is not None and Path(local).exists():
        return str(check_model_dir(cfg.path, Path(local)))
    if not cfg.path or not HUB_ID.match(cfg.path) or cfg.path.startswith((".", "~")):
        raise FileNotFoundError(
            f"target.path={cfg.path!r}: no such directory (a local model directory or a hub id like "
            "org/name is expected)"
        )
    return cfg.path


def check_model_dir(given: str, local: Path) -> Path:
    """`local` (what target.path=`given` names) if it is a model directory (it holds config.json); else an
    InputError naming target.path and what is there: a file, an empty directory, or other files."""
    if not local.is_dir():
        raise InputError(
            f"target.path={given!r}: {local} is a file, not a model directory (a Hugging Face model "
            "directory holding config.json, or a hub id like org/name, is expected)"
        )
    if not (local / "config.json").is_file():
        names = sorted(p.name for p in local.iterdir())
        held = (
            "it is empty" if not names else "it holds " + ", ".join(names[:5]) + (", ..." * (len(names) > 5))
        )
        raise InputError(
            f"target.path={given!r}: {local} has no config.json ({held}): not a Hugging Face model directory"
        )
    return local


def logit_transform(config) -> LogitTransform:
    """The model's processing of its LM head's output, read from its (text) config: the one place.
    softcap = final_logit_softcapping (Gemma-2/3); scale = 1 / logits_scaling (Granite, MiniCPM3),
    logit_scale (Cohere) or lm_head_multiplier (Falcon-H1). `check_output_logits` checks it."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    field = lambda name: getattr(text, name, None)  # noqa: E731
    scale = 1.0
    if field("logits_scaling"):
        scale /= float(field("logits_scaling"))
    for name in ("logit_scale", "lm_head_multiplier"):
        if field(name) is not None:
            scale *= float(field(name))
    softcap = field("final_logit_softcapping")
    return LogitTransform(scale=scale, softcap=float(softcap) if softcap else None)


@torch.no_grad()
def check_output_logits(model: PreTrainedModel, transform: LogitTransform, length: int = 8) -> None:
    """Refuse a model whose own logits are not `transform(lm_head(last hidden state))` on a short probe:
    its forward processes them in a way this adapter does not know, so verification, extraction's soft
    targets and training would all use another distribution than the model's."""
    vocab = int(model.get_output_embeddings().weight.shape[0])
    ids = (torch.arange(length, device=model.device) * 7 + 3) % vocab
    out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    ours = transform(model.get_output_embeddings()(out.hidden_states[-1])).float()
    theirs = out.logits.float()
    gap = float((ours - theirs).abs().max())
    # the same ops on the same inputs: equal up to a few units of the logits' rounding
    if gap > 4 * torch.finfo(out.logits.dtype).eps * (1.0 + float(theirs.abs().max())):
        fields = {k: getattr(model.config.get_text_config(), k, None) for k in LOGIT_FIELDS}
        raise InputError(
            f"{model.config.model_type}: the model's logits are not {transform} applied to lm_head(last hidden "
            f"state) (max difference {gap:.4g}); its forward post-processes them in a way eagle-train does "
            f"not reproduce (config fields {fields}), so this target is not supported"
        )


class TargetParts:
    """What a loaded `Target` and its `FrozenTarget` parts (modeling.frozen) share: shapes, length limits,
    the output processing and the weights' identity, from `config`, `cfg`, `source`, `embed_tokens` and
    `lm_head`."""

    config: PretrainedConfig
    cfg: TargetConfig
    source: str
    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    tokenizer: PreTrainedTokenizerBase
    generation_config: GenerationConfig  # the model's (its eos ids are stop ids)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    @property
    def max_len(self) -> int:
        """The longest sequence the target (and so the head) is used on."""
        limit = int(getattr(self.config, "max_position_embeddings", 0) or 0) or 2**31
        return min(self.cfg.max_len, limit) if self.cfg.max_len else limit

    def length_limit(self, requested: int | None = None) -> int:
        """The longest training sequence: `requested` (data.max_len) when given, else the preset's
        `train_max_len`, else `max_len`; never beyond `max_len`. The one home of this rule (extraction,
        online training, regeneration)."""
        return min(requested or self.cfg.train_max_len or self.max_len, self.max_len)

    @property
    def stop_token_ids(self) -> list[int]:
        """EOS ids of the tokenizer and generation config plus the config's extra stop ids."""
        ids: list[int] = list(self.cfg.stop_token_ids)
        for source in (
            self.tokenizer.eos_token_id,
            getattr(self.generation_config, "eos_token_id", None),
        ):
            for i in source if isinstance(source, list) else [source]:
                if i is not None and int(i) not in ids:
                    ids.append(int(i))
        return ids

    @functools.cached_property
    def logit_transform(self) -> LogitTransform:
        """The model's own processing of its LM head's output (eagle_train.modeling.logit_transform)."""
        return logit_transform(self.config)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits from last hidden states: its output processing applied to lm_head(hidden)."""
        return self.logit_transform(self.lm_head(hidden))

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @functools.cached_property
    def aux_layers(self) -> list[int]:
        """EAGLE-3's feature layers: `target.aux_layers` checked against this target, or the default."""
        return resolve_aux_layers(self.cfg.aux_layers, self.num_layers)

    @functools.cached_property
    def weight_fingerprint(self) -> dict[str, str]:
        """sha256 (16 hex digits) of the input embedding and the LM head: two models with one config
        shape (a base model and its fine-tune) differ here. The weights are rounded to bfloat16 first,
        so a float32 and a bfloat16 load of one checkpoint agree. A second or two for an 8B model."""
        out = {}
        for name, weight in (("embed_tokens", self.embed_tokens.weight), ("lm_head", self.lm_head.weight)):
            data = weight.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy()
            out[name] = hashlib.sha256(memoryview(data).cast("B")).hexdigest()[:16]
        return out

    @functools.cached_property
    def weight_files(self) -> dict[str, str]:
        """{file name: sha256} of every weight file of the target's checkpoint (modeling.frozen.
        checkpoint_sha256): the identity of all its weights, decoder layers included, so a fine-tune of
        any layer differs here (`weight_fingerprint` covers the embedding and LM head only). Read from
        the files, cached by path, size and times: no tensor is loaded, and after the first time it
        costs a stat per file."""
        from eagle_train.modeling.frozen import checkpoint_sha256  # frozen builds on this module

        return checkpoint_sha256(self.source, self.cfg.revision)


@dataclass
class Target(TargetParts):
    """A frozen causal LM with its tokenizer. `model` is the stock Hugging Face model."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    cfg: TargetConfig
    source: str

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def decoder(self) -> nn.Module:
        """The base transformer (embeddings + layers + final norm), without the LM head."""
        return self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model

    @property
    def generation_config(self) -> GenerationConfig:
        return self.model.generation_config

    @torch.no_grad()
    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the target on a (right- or left-padded) batch.

        input_ids, attention_mask: [batch, seq]. Returns (logits [batch, seq, vocab],
        hidden [batch, seq, hidden]) where hidden is the last hidden state after the final norm,
        i.e. logits == the model's own logits (its output processing applied to lm_head(hidden)).
        """
        hidden = self.decoder(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        return self.logits(hidden), hidden

    @torch.no_grad()
    def next_logits(self, ids: list[int]) -> torch.Tensor:
        """The model's logits [vocab] for the token after `ids` (one forward)."""
        logits, _ = self.features(torch.tensor([ids], device=self.device))
        return logits[0, -1]

    @torch.no_grad()
    def hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Only the last hidden state [batch, seq, hidden] (cheaper: no vocabulary projection)."""
        return self.decoder(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state

    @torch.no_grad()
    def aux_hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layers: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last hidden state [batch, seq, hidden] and the inputs of `layers` concatenated in that
        order [batch, seq, len(layers) * hidden] (EAGLE-3's features), from one forward."""
        out = self.decoder(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True
        )
        return out.last_hidden_state, select_layers(out.hidden_states, layers)

    @property
    def attention(self) -> str:
        """The model's own attention implementation (its decoder's: a composite model's text model)."""
        return self.decoder.config._attn_implementation

    @functools.cached_property
    def decode_attention(self) -> str:
        """The attention implementation of decode-time forwards (`decode`: tree verification, and `ar`, the
        same cache code): the model's own when it takes a 4-D mask (eager, sdpa), else sdpa (eager for a
        model without sdpa). Extraction, online training and HF `generate` keep the model's own."""
        own = self.attention
        if own in DECODE_ATTENTION:
            return own
        fallback = "sdpa" if getattr(self.model, "_supports_sdpa", False) else "eager"
        log.warning(
            "attn_implementation=%s cannot take a tree's 4-D attention mask: decode-time forwards (tree "
            "verification and the ar baseline) run %s; HF generate (method hf) keeps %s",
            own,
            fallback,
            own,
        )
        return fallback

    @functools.cached_property
    def attention_layout(self) -> AttentionLayout:
        """The windows of the masks the model reads (UnsupportedAttention for what decoding cannot
        reproduce: recurrent layers, chunked or bidirectional attention)."""
        return attention_layout(self.decoder.config)

    @functools.cached_property
    def cache_shape(self) -> tuple[int, int, int]:
        """(key/value heads, key width, value width) as the model's attention layers write them to a cache,
        read off a one-token forward (MLA's keys and values differ in width; every layer must agree)."""
        recorder = CacheShapeRecorder()
        decoder, cache_kwarg, _ = self._decode_modules
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        mask = additive_mask(torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device), self.dtype)
        try:
            with torch.no_grad(), attention_implementation(decoder.config, self.decode_attention):
                decoder(input_ids=ids, position_ids=ids, attention_mask=mask, use_cache=True,
                        **{cache_kwarg: recorder})  # fmt: skip
        except (AttributeError, NotImplementedError, TypeError) as error:
            raise UnsupportedAttention(
                f"{self.config.model_type}: its layers use a cache the built-in decoder does not provide "
                f"({type(error).__name__}: {error}); not supported by the built-in decoder"
            ) from error
        shapes = set(recorder.shapes.values())
        if len(recorder.shapes) != self.num_layers or len(shapes) != 1:
            raise UnsupportedAttention(
                f"{self.config.model_type}: {len(recorder.shapes)} of {self.num_layers} layers write a key/value "
                f"cache, of shapes {sorted(shapes)}; the built-in decoder's cache needs one shape in every layer"
            )
        return shapes.pop()

    @functools.cached_property
    def decode_checked(self) -> bool:
        """True once `check_decode` passed for this target (run at the first `new_cache`)."""
        check_decode(self)
        return True

    def new_cache(self, capacity: int) -> StaticKVCache:
        """A preallocated KV cache for one sequence of up to `capacity` tokens (the first call checks that
        decode-time forwards reproduce the model: `check_decode`)."""
        assert self.decode_checked
        return self._cache(capacity)

    def _cache(self, capacity: int) -> StaticKVCache:
        heads, key_dim, value_dim = self.cache_shape
        return StaticKVCache(
            self.num_layers,
            heads,
            key_dim,
            capacity,
            dtype=self.dtype,
            device=self.device,
            value_dim=value_dim,
        )

    @torch.no_grad()
    def decode(
        self,
        input_ids: torch.Tensor,  # [1, q]: new tokens
        position_ids: torch.Tensor,  # [1, q]: their positions (prefix length + depth for a tree)
        attention_mask: torch.Tensor,  # bool [1, 1, q, cache.seq_len + q], True = attend
        cache: StaticKVCache,
        aux_layers: list[int] | None = None,
        last_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One cached forward of the stock model over new tokens. Their keys/values are written after
        the committed slots of `cache` (not committed: call `cache.advance` or `cache.compact`).
        Returns (logits [1, q, vocab], features): the last hidden state [1, q, hidden] (EAGLE-1's f,
        after the norm), or with `aux_layers` the inputs of those layers [1, q, 3 * hidden] (EAGLE-3).
        `last_logits`: the logits of the last new token only, [1, 1, vocab] (a prefill reads no other: the
        LM head over a long prompt's every position is most of a small model's prefill, and `generate`
        skips it too)."""
        attention = self.decode_attention
        layout = self.attention_layout
        frozen = self._frozen_decoder
        if frozen is not None and layout.max_window is None and frozen.fits(input_ids.shape[1], cache):
            with attention_implementation(self.decoder.config, attention):
                logits, hidden, hidden_states = frozen(input_ids, position_ids, attention_mask, cache)
            logits = logits[:, -1:] if last_logits else logits
            return logits, hidden if aux_layers is None else select_layers(hidden_states, aux_layers)
        if layout.max_window is None:
            attention_mask = additive_mask(attention_mask, self.dtype)
        else:  # committed slot i holds position i (the decoder compacts every accepted path)
            queries = position_ids[0]
            keys = torch.cat([torch.arange(cache.seq_len, device=queries.device), queries])
            attention_mask = layout.masks(attention_mask, queries, keys, self.dtype)
        decoder, cache_kwarg, lm_head = self._decode_modules
        if self.cfg.compile_decode:
            decoder = self._compiled_decoder
        # output_hidden_states always passed: a compiled decoder guards on the number of keywords
        kwargs = {cache_kwarg: HFCacheView(cache), "output_hidden_states": aux_layers is not None}
        with attention_implementation(decoder.config, attention):
            out = decoder(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                use_cache=True,
                **kwargs,
            )
        hidden = out.last_hidden_state
        logits = lm_head(hidden[:, -1:] if last_logits else hidden)
        logits = logits if self.logit_transform.identity else self.logit_transform(logits)
        return logits, hidden if aux_layers is None else select_layers(out.hidden_states, aux_layers)

    @functools.cached_property
    def _decode_modules(self) -> tuple[nn.Module, str, nn.Module]:
        """(decoder, its cache keyword, LM head) for `decode`, looked up once: `get_decoder`, the
        signature check and `get_output_embeddings` cost tens of microseconds per forward."""
        decoder = self.decoder
        return decoder, _cache_kwarg(type(decoder)), self.lm_head

    @functools.cached_property
    def _compiled_decoder(self) -> nn.Module:
        """The decoder under `torch.compile` (target.compile_decode), compiled at its first forward. Shapes
        are dynamic from the start (the query count and the cache length change every call); dynamo traces
        through `HFCacheView` without a graph break on Llama-style models, and a model it cannot trace
        runs in pieces (graph breaks), never wrong."""
        allow_recompiles()
        return torch.compile(self._decode_modules[0], dynamic=True, options=self.compile_options)

    @functools.cached_property
    def _frozen_decoder(self) -> FrozenDecoder | None:
        """target.compile_frozen's graphs for forwards of up to 16 new tokens (modeling.frozen_step); None when
        off. Windowed targets keep compile_decode's graphs (their masks are per layer type)."""
        if not (self.cfg.compile_decode and self.cfg.compile_frozen):
            return None
        decoder, cache_kwarg, lm_head = self._decode_modules
        cpp = self.compile_options["cpp_wrapper"]
        allow_recompiles()
        return FrozenDecoder(decoder, lm_head, self.logit_transform, cache_kwarg, self.dtype, cpp)

    @property
    def compile_options(self) -> dict[str, bool]:
        """Inductor's options for the compiled decoder: its C++ wrapper where target.compile_cpp_wrapper
        says so (null: on a CPU). The kernels are the same either way; only the calls between them move out
        of Python (stories260K, one thread: `ar` 5-8% faster in tokens/s, docs/benchmarks.md)."""
        cpp = self.cfg.compile_cpp_wrapper
        return {"cpp_wrapper": self.device.type == "cpu" if cpp is None else bool(cpp)}


def allow_recompiles() -> None:
    """Raise dynamo's graph limit per compiled function to RECOMPILE_LIMIT. A process decodes several kinds of
    forward, each its own graph: one-token steps and wider ones, with and without aux features, the prompt (as
    many queries as keys), inference-mode tensors or not, a full cache, each padded query count of
    target.compile_frozen. Past dynamo's default of 8 graphs the rest would silently run uncompiled."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


def select_layers(hidden_states: tuple[torch.Tensor, ...], layers: list[int]) -> torch.Tensor:
    """Hugging Face's `hidden_states` (index i < L: the input of layer i) -> the chosen inputs
    concatenated along the hidden axis [batch, seq, len(layers) * hidden]."""
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


class HFCacheView:
    """A `StaticKVCache` seen through the Hugging Face `Cache` calls the attention layers make."""

    is_compileable = False

    def __init__(self, cache: StaticKVCache):
        self.cache = cache

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.cache.update(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.seq_len


class CacheShapeRecorder:
    """A cache that keeps nothing and records the (heads, key width, value width) each layer writes."""

    is_compileable = False

    def __init__(self):
        self.shapes: dict[int, tuple[int, int, int]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.shapes[layer_idx] = (key_states.shape[1], key_states.shape[-1], value_states.shape[-1])
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


@functools.cache
def _cache_kwarg(decoder_type: type) -> str:
    """`cache` in transformers >= 5.x (past_key_values is deprecated there), else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(decoder_type.forward).parameters else "past_key_values"


def load_tokenizer(cfg: TargetConfig) -> PreTrainedTokenizerBase:
    """The target's tokenizer (no model weights loaded)."""
    return AutoTokenizer.from_pretrained(
        target_source(cfg), trust_remote_code=cfg.trust_remote_code, revision=cfg.revision
    )


def load_target_config(cfg: TargetConfig):
    """The target's Hugging Face config (no weights loaded). A hub id the hub cannot provide (offline, no
    such repository, no access) is an InputError naming target.path."""
    source = target_source(cfg)
    try:
        return AutoConfig.from_pretrained(
            source, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision
        )
    except OSError as err:
        if Path(source).is_dir():
            raise
        raise InputError(
            f"target.path={cfg.path!r}: no local directory of that name, and the hub cannot provide it "
            f"({error_reason(err)})"
        ) from None


def check_preset_ids(cfg: TargetConfig, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    """InputError naming the preset (target.name) and the id when the preset does not fit the model: a stop
    id outside the model's `vocab_size` rows, a special token of the tokenizer (BOS, EOS, PAD, UNK) outside
    them, or a fallback chat template (used when the tokenizer has none, or target.force_template) whose
    turn markers (`<|im_start|>`, `<|eot_id|>`, ...) this tokenizer does not have as one token."""
    where = f"target={cfg.name} (target.path={cfg.path})"
    for i in cfg.stop_token_ids:
        if not 0 <= int(i) < vocab_size:
            raise InputError(
                f"{where}: stop_token_ids holds {i}, outside the model's vocabulary of {vocab_size} tokens: "
                "the preset is for another model (choose this model's preset, or set target.stop_token_ids)"
            )
    for name in ("bos", "eos", "pad", "unk"):
        i = getattr(tokenizer, f"{name}_token_id", None)
        if i is not None and not 0 <= int(i) < vocab_size:
            raise InputError(
                f"{where}: the tokenizer's {name.upper()} id {i} is outside the model's vocabulary of "
                f"{vocab_size} tokens: the tokenizer is another model's"
            )
    if cfg.chat_template is None or (getattr(tokenizer, "chat_template", None) and not cfg.force_template):
        return
    template = TEMPLATES.get(cfg.chat_template)
    text = "".join(str(v) for v in vars(template).values()) if template else ""
    for marker in sorted(set(re.findall(r"<\|[^|<>\s]+\|>", text))):
        i = tokenizer.convert_tokens_to_ids(marker)
        if i is None or i == tokenizer.unk_token_id or not 0 <= int(i) < vocab_size:
            raise InputError(
                f"{where}: chat_template={cfg.chat_template} marks turns with {marker}, which is no token of "
                "this model's tokenizer: the preset is for another model (choose this model's preset, or set "
                "target.chat_template)"
            )


def attention_to_load(cfg: TargetConfig) -> str:
    """`target.attn_implementation`, or when unset sdpa where the model's class has it and eager where it
    has not (gpt-oss). sdpa asked for a model without it is refused naming the model and the choices."""
    if cfg.attn_implementation not in (None, "sdpa"):
        return cfg.attn_implementation
    config = load_target_config(cfg)
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # remote code or a composite config: transformers decides
        return cfg.attn_implementation or "sdpa"
    if getattr(model_class, "_supports_sdpa", True):
        return "sdpa"
    if cfg.attn_implementation == "sdpa":
        raise InputError(
            f"target.attn_implementation=sdpa: {model_class.__name__} has no sdpa attention in transformers "
            f"{transformers_version}; use eager (or leave target.attn_implementation unset)"
        )
    log.info("%s has no sdpa attention: loading it with eager", model_class.__name__)
    return "eager"


def error_reason(err: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message` (cut to `limit` characters): a reader's error in one line (torch's
    and safetensors' run over several, naming no file; the caller names it)."""
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_target(cfg: TargetConfig, device: torch.device | str = "cpu") -> Target:
    """Load the target frozen, in eval mode, on `device` with the configured dtype; with
    `cfg.device_map` spread by accelerate over the devices it names (`device` is then unused: inputs go
    to the model's first device, `Target.device`)."""
    source = target_source(cfg)
    dtype = "auto" if cfg.dtype == "auto" else torch_dtype(cfg.dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=dtype,
            trust_remote_code=cfg.trust_remote_code,
            revision=cfg.revision,
            attn_implementation=attention_to_load(cfg),
            device_map=cfg.device_map,
        )
    except (SafetensorError, pickle.UnpicklingError) as err:  # a weight file cut short, or forged
        raise InputError(
            f"target {source}: a weight file cannot be read ({error_reason(err)}): damaged, or not a "
            "checkpoint of plain tensors"
        ) from None
    if cfg.device_map is None:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    check_output_logits(model, logit_transform(model.config))
    tokenizer = load_tokenizer(cfg)
    check_preset_ids(cfg, tokenizer, int(model.get_output_embeddings().weight.shape[0]))
    return Target(model=model, tokenizer=tokenizer, cfg=cfg, source=source)
