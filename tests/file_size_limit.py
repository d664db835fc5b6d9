"""Run a stage as if the disk filled up: no file it writes may grow beyond BYTES (RLIMIT_FSIZE; the
write that would cross it fails with EFBIG, as a write to a full disk fails with ENOSPC). The fault is
injected here, from the test side.

    python tests/file_size_limit.py BYTES MODULE [hydra overrides...]
"""

from __future__ import annotations

import importlib
import resource
import signal
import sys


def main() -> None:
    limit, module_name = int(sys.argv[1]), sys.argv[2]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the signal killing us
    module = importlib.import_module(module_name)  # imports may write caches: before the limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    sys.argv = [module_name, *sys.argv[3:]]
    module.main()


if __name__ == "__main__":
    main()
