"""Run a stage and kill it, as SIGKILL would (`os._exit`: no cleanup, no finally), right after the N-th
call of one of its functions returns. The fault is injected here, from the test side; the stage has no
hook for it.

    python tests/kill_after.py MODULE FUNCTION N [hydra overrides...]
    python tests/kill_after.py eagle_train.extract write_shard 1 data=fastchat_dummy out_dir=DIR
"""

from __future__ import annotations

import importlib
import os
import sys

KILLED = 17  # the exit code the test sees


def main() -> None:
    module_name, function, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
    module = importlib.import_module(module_name)
    original = getattr(module, function)
    done = 0

    def wrapped(*args, **kwargs):
        nonlocal done
        result = original(*args, **kwargs)
        done += 1
        if done >= calls:
            os._exit(KILLED)
        return result

    setattr(module, function, wrapped)
    sys.argv = [module_name, *sys.argv[4:]]
    module.main()


if __name__ == "__main__":
    main()
