"""Stage 3, `python -m eagle_train.evaluate draft.path=DIR bench=mt_bench`: what a draft head is worth."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eagle_train.config.decode import METHODS, PLAIN_METHODS, SHAPE_DEFAULTS, DecodeConfig, method_name
from eagle_train.config.draft import DraftConfig
from eagle_train.config.target import TargetConfig

ENGINES = ("builtin", "vllm")
# vLLM's training-free methods the serving sweep can run beside a head (engine_baselines), with their settings
# beyond the draft count (eagle_train.engines.vllm_engine.baseline_speculative_config). ngram matches the last
# 2 to 5 tokens against the prompt and the answer so far (vLLM's own default, 5 only, finds fewer matches in
# short chat answers); suffix takes vLLM's defaults.
ENGINE_BASELINES: dict[str, dict[str, Any]] = {
    "ngram": {"prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {},
}


@dataclass
class EvaluateConfig:
    """Benchmarks x methods, each answer decoded by every method in turn, timed in one harness."""

    target: TargetConfig = field(default_factory=TargetConfig)  # the frozen target model
    draft: DraftConfig = field(default_factory=DraftConfig)  # draft.path: the head to evaluate (any layout)
    # shared decode settings (the method is set per run); answers of up to 256 tokens; the chain length, the
    # EAGLE-2 shape and the EAGLE-1 tree are chosen per benchmark from measured costs (decode.shape=fixed,
    # decode.tree=NAME: as given)
    decode: DecodeConfig = field(
        default_factory=lambda: DecodeConfig(max_new_tokens=256, shape="auto", tree="auto")
    )
    # benchmark names (mt_bench humaneval gsm8k alpaca sum qa tinystories) or JSONL paths; one name or a list
    bench: Any = "mt_bench"
    methods: list[str] = field(
        default_factory=lambda: ["ar", "chain", "static_tree", "dynamic_tree"]
    )  # ar is the baseline
    num_questions: int | None = None  # first N questions per benchmark (null = all)
    max_turns: int | None = None  # first N turns per question (null = all; mt_bench has 2)
    out_dir: str = "outputs/eval/${target.name}"  # answers.jsonl, report.json, report.md, *.png
    warmup: int = 1  # questions decoded untimed by every method first (allocator and kernel warm-up)
    min_rounds: int = 50  # fewer speculative rounds per (bench, method) puts a warning in the report
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    # torch intra-op threads on the CPU (null = measured: the faster of 1 and torch's default for the target's
    # forwards, eagle_train.autotune.costs.choose_threads); a tiny target on a busy CPU runs far faster with 1
    # (measured here under load: stories260K greedy 64 tokens 0.27 s with 1 thread, 4.2 s with 2)
    num_threads: int | None = None
    # decode.shape=auto: held-out prompts per benchmark (the questions after the first num_questions; the
    # first ones when there are none) decoded greedily to calibrate the head's acceptance of every shape
    tune_prompts: int = 3
    tune_tokens: int = 128  # tokens decoded per calibration prompt (at most decode.max_new_tokens)
    # then the best predicted EAGLE-2 shape of this many of the fastest predicted (depth, top_k) pairs are
    # timed on the calibration prompts, side by side, and the fastest measured is chosen (0 or 1: the
    # model's choice as it is; autotune.shapes.race_shapes)
    tune_race: int = 4
    # the tuning of a benchmark (greedy calibration decoding, replay, the real decoder's phases, the race) may
    # take this share of the benchmark's evaluation, estimated as its answers x methods x max_new_tokens at
    # plain decoding's measured seconds per token; each part stops at its share after a floor of work (one
    # prompt, 16 positions, one phase prompt) and the race is dropped when it does not fit
    # (eagle_train.autotune.budget; null: unbounded). The cost curves are outside it: measured once per
    # machine and model, then cached
    tune_share: float | None = 0.1
    # the race is skipped when the model's fastest predicted depth / top_k pair beats the next by this factor
    tune_decisive: float = 1.05
    # greedy identity: a differing answer whose first differing token has both candidates within this many
    # ulps of the top logit (in the target's dtype) is a near-tie, not a real divergence (decoding.identity)
    near_tie_ulps: int = 4
    # greedy answers checked against the MODEL itself: one teacher-forced, cache-free forward of the target over
    # prompt + answer must choose every answer token (decoding.identity.check_against_model). ar shares the
    # speculative methods' cache and mask code; this is the reference that does not. One forward per distinct
    # answer (answers identical to ar's share its check): far cheaper than decoding it
    check_model: bool = True
    plots: bool = True  # write the PNG plots
    # builtin: this project's decoder only | vllm: also run the head in a real vLLM on the same prompt token
    # ids (no speculation, and a chain of decode.chain_length tokens) and report both engines side by side
    engine: str = "builtin"
    engine_python: str | None = None  # vLLM's own python (null = .venv-vllm/bin/python, from `make vllm-env`)
    # a running `vllm serve TARGET --speculative-config ...` to use instead of starting vLLM (OpenAI API
    # base URL, e.g. http://127.0.0.1:8000); it must serve this target with this head at decode.chain_length
    engine_url: str | None = None
    # what the head is worth under load (engine=vllm): vLLM's own serving benchmark (`vllm bench serve`) at each
    # of these concurrency levels, on a server without the head and one with it (a chain of
    # decode.chain_length), e.g. [1,4,16,64]; empty: no serving sweep (docs/serving-under-load.md)
    engine_concurrency: list[int] = field(default_factory=list)
    # requests per level: the evaluation's first-turn prompts in order, repeated when more are asked for (null:
    # each once, and at least as many as the highest level)
    engine_num_prompts: int | None = None
    # the sweep on running servers instead of starting them: this one serves the target WITHOUT speculation,
    # engine_url the same target with the head (both or neither)
    engine_plain_url: str | None = None
    # extra `vllm serve` flags for the servers the sweep starts (e.g. [--enforce-eager] on a CPU: no compile)
    engine_serve_args: list[str] = field(default_factory=list)
    # vLLM's own training-free speculation served beside plain and the head in the serving sweep, at the same
    # levels on the same requests: ngram (prompt lookup; settings: ENGINE_BASELINES above) and
    # suffix (suffix decoding: vLLM needs the arctic-inference package for it, or refuses to start)
    engine_baselines: list[str] = field(default_factory=list)
    engine_ready_timeout_s: float = (
        600  # a started server that is not ready by then is an error (its log named)
    )
    progress: bool = True  # tqdm progress bars

    def __post_init__(self) -> None:
        if isinstance(self.bench, str):
            self.bench = [self.bench]
        self.bench = [str(b) for b in self.bench]
        if not self.bench:
            raise ValueError("bench: name at least one benchmark")
        self.methods = [method_name(str(m)) for m in self.methods]
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"methods must be a non-empty list of {METHODS}, got {self.methods}")
        if any(m not in PLAIN_METHODS for m in self.methods) and not self.draft.path:
            raise ValueError("speculative methods need a head: set draft.path=DIR (or methods=[ar])")
        if self.num_questions is not None and self.num_questions < 1:
            raise ValueError(f"num_questions must be >= 1 or null, got {self.num_questions}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1 or null, got {self.max_turns}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or null, got {self.num_threads}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine != "builtin" and self.decode.temperature != 0:
            raise ValueError("engine=vllm compares greedy decoding: set decode.temperature=0")
        if self.engine != "builtin" and not self.draft.path:
            raise ValueError("engine=vllm runs a head: set draft.path=DIR")
        if (
            self.engine != "builtin"
        ):  # the engines are compared on chain (vLLM drafts one) against plain decoding
            self.methods += [m for m in ("ar", "chain") if m not in self.methods]
            if self.decode.chain_length is None:  # vLLM's chain is as given (its default), never tuned
                self.decode.chain_length = SHAPE_DEFAULTS["chain"]["chain_length"]
        self.check_serving()
        if self.tune_prompts < 1 or self.tune_tokens < 2 or self.tune_race < 0:
            raise ValueError("tune_prompts must be >= 1, tune_tokens >= 2 and tune_race >= 0")
        if self.tune_share is not None and not 0 < self.tune_share <= 1:
            raise ValueError(f"tune_share must be in (0, 1] or null (unbounded), got {self.tune_share}")
        if self.tune_decisive < 1:
            raise ValueError(f"tune_decisive is a factor >= 1 (1: never race), got {self.tune_decisive}")
        if self.warmup < 0 or self.min_rounds < 0 or self.near_tie_ulps < 0:
            raise ValueError("warmup, min_rounds and near_tie_ulps must be >= 0")

    def check_serving(self) -> None:
        """The serving sweep's keys: levels >= 1 (run in ascending order), both server URLs or neither."""
        levels = [int(c) for c in self.engine_concurrency]
        if any(c < 1 for c in levels) or len(set(levels)) != len(levels):
            raise ValueError(
                f"engine_concurrency must be distinct levels >= 1, got {self.engine_concurrency}"
            )
        self.engine_concurrency = sorted(levels)
        if levels and self.engine != "vllm":
            raise ValueError("engine_concurrency runs vLLM's serving benchmark: set engine=vllm")
        if self.engine_plain_url and not self.engine_url:
            raise ValueError(
                "engine_plain_url (the server without the head) needs engine_url (the one with it)"
            )
        if levels and self.engine_url and not self.engine_plain_url:
            raise ValueError(
                "engine_concurrency compares a server without the head and one with it: set engine_plain_url "
                "beside engine_url, or neither (the stage then starts both)"
            )
        unknown = [b for b in self.engine_baselines if b not in ENGINE_BASELINES]
        if unknown or len(set(self.engine_baselines)) != len(self.engine_baselines):
            raise ValueError(
                f"engine_baselines must be distinct names of {list(ENGINE_BASELINES)}, got {self.engine_baselines}"
            )
        if self.engine_baselines and (not levels or self.engine_url):
            raise ValueError(
                "engine_baselines are servers the serving sweep starts beside plain and the head: set "
                "engine_concurrency, and no engine_url"
            )
        if self.engine_num_prompts is not None and self.engine_num_prompts < 1:
            raise ValueError(f"engine_num_prompts must be >= 1 or null, got {self.engine_num_prompts}")
        if self.engine_ready_timeout_s <= 0:
            raise ValueError(f"engine_ready_timeout_s must be > 0, got {self.engine_ready_timeout_s}")
