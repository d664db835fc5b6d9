"""Run a stage and kill it, as SIGKILL would (`os._exit`: no cleanup, no finally), right after the N-th
call of one of its functions returns. The fault is injected here, from the test side; the stage has no
hook for it. FUNCTION is a name in the stage module, or `other.module:name` for a function the stage
reaches through another module (patched there).

    python tests/kill_after.py MODULE FUNCTION N [hydra overrides...]
    python tests/kill_after.py eagle_train.extract write_shard 1 data=fastchat_dummy out_dir=DIR
    python tests/kill_after.py eagle_train.train eagle_train.modeling.head_checkpoint:save_file 2 ...
"""

from __future__ import annotations

import importlib
import os
import sys

KILLED = 17  # the exit code the test sees


def main() -> None:
    module_name, function, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
    module = importlib.import_module(module_name)
    owner_name, _, function = function.rpartition(":")
    owner = importlib.import_module(owner_name) if owner_name else module
    original = getattr(owner, function)
    done = 0

    def wrapped(*args, **kwargs):
        nonlocal done
        result = original(*args, **kwargs)
        done += 1
        if done >= calls:
            os._exit(KILLED)
        return result

    setattr(owner, function, wrapped)
    sys.argv = [module_name, *sys.argv[4:]]
    module.main()


if __name__ == "__main__":
    main()
