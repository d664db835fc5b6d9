"""Config plumbing: the repository root, path resolution and DictConfig -> dataclass conversion."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

# The package lives at <repo>/eagle_train/config/base.py in an editable install (`pip install -e .`),
# which is how this project is installed; `conf/` and the shared data are found from here.
REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"

T = TypeVar("T")


def resolve_path(path: str | Path | None) -> Path | None:
    """An absolute path as is; a relative one against the current directory if it exists there,
    else against the repository root (so `../shared/...` works from anywhere)."""
    if path is None or str(path) == "":
        return None
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p.resolve() if p.exists() else p
    candidate = REPO_ROOT / p
    return candidate.resolve() if candidate.exists() else p


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("repo"):
        # ${repo:../shared/models/stories260K} -> absolute path under the repository root
        OmegaConf.register_new_resolver("repo", lambda rel="": str((REPO_ROOT / rel).resolve()))


_register_resolvers()


def to_schema(cfg: DictConfig | dict, schema: type[T]) -> T:
    """Validate `cfg` against the dataclass `schema` (unknown keys and wrong types raise) and return
    the dataclass instance. `__post_init__` cross-field checks run here."""
    structured = OmegaConf.structured(schema)
    merged = OmegaConf.merge(structured, cfg)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def config_hash(obj: Any, length: int = 16) -> str:
    """A stable short hash of a dataclass or mapping (sorted JSON)."""
    data = asdict(obj) if is_dataclass(obj) else obj
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]
