"""Config plumbing: where the shipped configs and data live, path resolution, DictConfig -> dataclass.

The repository's `conf/` (Hydra configs) and `data/` (the embedded target, TinyStories, the benchmark
question sets, small ShareGPT files; see data/README.md) ship inside the package: a wheel carries them as
`eagle_train/conf` and `eagle_train/assets` (pyproject's package-dir), a source checkout or editable
install reads them from the repository beside the package. Shipped data is named in YAML as
`${data:models/stories260K}`; nothing is looked up relative to the current directory, and nothing
outside the package or the repository is read unless a path says so.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagle_train.runtime.errors import ConfigError

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _shipped(in_wheel: str, in_repo: str) -> Path:
    """A shipped folder: inside the installed package (wheel), else beside it in the repository."""
    inside = PACKAGE_DIR / in_wheel
    return inside if inside.is_dir() else PACKAGE_DIR.parent / in_repo


CONF_DIR = _shipped("conf", "conf")
DATA_DIR = _shipped("assets", "data")
DATA_PREFIX = "${data:"

T = TypeVar("T")


def data_path(rel: str = "") -> Path:
    """A shipped data file or folder, e.g. data_path("models/stories260K")."""
    return DATA_DIR / rel


def expand_data_ref(path: str) -> str:
    """`${data:REL}` (the Hydra resolver, here for a dataclass built without Hydra) -> an absolute path."""
    if path.startswith(DATA_PREFIX) and path.endswith("}"):
        return str(data_path(path[len(DATA_PREFIX) : -1]))
    return path


def resolve_path(path: str | Path | None) -> Path | None:
    """A user-given path: `~` expanded, `${data:...}` expanded, relative paths against the current
    directory (made absolute when they exist). None or "" -> None."""
    if path is None or str(path) == "":
        return None
    p = Path(expand_data_ref(str(path))).expanduser()
    return p.resolve() if p.exists() else p


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("data"):
        # ${data:models/stories260K} -> the shipped data folder's file (absolute path)
        OmegaConf.register_new_resolver("data", lambda rel="": str(data_path(rel)))
    if not OmegaConf.has_resolver("per_process"):
        # ${per_process:4096,${vars.processes}} -> 2048 on 2 processes: one total shared out evenly
        OmegaConf.register_new_resolver("per_process", per_process)


def per_process(total: int, processes: int) -> int:
    """`total` split evenly over `processes` (a batch's tokens: the same optimizer step on any count)."""
    total, processes = int(total), int(processes)
    if processes < 1 or total % processes:
        raise ValueError(f"per_process: {total} does not split evenly over {processes} processes")
    return total // processes


_register_resolvers()


def to_schema(cfg: DictConfig | dict, schema: type[T]) -> T:
    """Validate `cfg` against the dataclass `schema` and return the dataclass instance. `__post_init__`
    cross-field checks run here. An unknown key, a wrong type or a value a check refuses is a ConfigError
    (a ValueError) with the message on one line."""
    try:
        structured = OmegaConf.structured(schema)
        merged = OmegaConf.merge(structured, cfg)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except (ValueError, OmegaConfBaseException) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(config_message(err)) from err


def config_message(err: BaseException) -> str:
    """OmegaConf's (or Hydra's) message on one line: the key it names kept, its type bookkeeping dropped."""
    lines = [line.strip() for line in str(err).splitlines()]
    return " ".join(
        line for line in lines if line and not line.startswith(("object_type=", "reference_type="))
    )


def config_hash(obj: Any, length: int = 16) -> str:
    """A stable short hash of a dataclass or mapping (sorted JSON)."""
    data = asdict(obj) if is_dataclass(obj) else obj
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def mismatches(
    expected: dict[str, Any], found: dict[str, Any], labels: tuple[str, str] = ("expected", "found")
) -> list[str]:
    """One line per dotted field whose value differs: 'field: expected X, found Y' (`labels` name the
    two sides)."""
    exp, got = flatten(expected), flatten(found)
    return [
        f"{key}: {labels[0]} {exp.get(key, '<missing>')!r}, {labels[1]} {got.get(key, '<missing>')!r}"
        for key in sorted(set(exp) | set(got))
        if exp.get(key, "<missing>") != got.get(key, "<missing>")
    ]


def flag_argv(argv: list[str]) -> list[str]:
    """`key=value` arguments (Hydra-like) as argparse's `--key=value`, for the small argparse commands
    (`eagle_train.data.tinystories`, `eagle_train.data.mix`); `--key value` passes unchanged."""
    return [f"--{a}" if "=" in a and not a.startswith("-") else a for a in argv]
