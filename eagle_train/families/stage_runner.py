"""`python -m eagle_train.families.stage_runner`: the family matrix's stage commands, each run exactly as
`python -m MODULE ARGS` runs it, in a process of its own, forked from this one after it imported every stage
module once.

A stage's process spends about 9 CPU-seconds importing torch, transformers (its modeling_utils alone about
5 s) and the package before it reads its command line; on a tiny family that is most of a stage, and the
matrix runs fourteen stages per family. Here that import happens once per family. Each stage is then a
forked child: its own process state (Hydra, accelerate's and torch's globals start as a new process's do),
its command line in `sys.argv`, stdout and stderr in its log, the module's `main()` (the Hydra edge,
eagle_train.cli.stage_main), its own exit status and CPU seconds (`os.wait4`), and a normal interpreter exit
(atexit handlers run as they would). This process starts no thread and runs no torch operation before it
forks (OMP_NUM_THREADS=1 is set by the caller), so nothing a child needs is held by a thread that is gone.

Protocol: one JSON request per line on stdin, `{"log": PATH, "module": NAME, "args": [...]}`; one JSON
reply per line on stdout, `{"ok", "wall_s", "cpu_s"}`. Anything the imports print goes to stderr.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

MODULES = ("regenerate", "extract", "train", "export", "evaluate")


def become_stage(request: dict) -> None:
    """In the forked child: point stdout and stderr at the log, run the stage as its command would, exit
    (never returns: SystemExit unwinds to the interpreter's own exit)."""
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    module, args = request["module"], request["args"]
    print(
        f"$ OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python -m {module} {' '.join(args)}",
        flush=True,
    )
    sys.argv = [module, *args]
    importlib.import_module(module).main()
    sys.exit(0)


def run(request: dict, replies) -> None:
    """Fork, let the child become the stage, wait for it; reply with its outcome."""
    sys.stdout.flush()
    sys.stderr.flush()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        become_stage(request)
    _, status, usage = os.wait4(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    reply = {"ok": code == 0, "wall_s": round(time.perf_counter() - start, 1),
             "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "exit_code": code}  # fmt: skip
    replies.write(json.dumps(reply) + "\n")
    replies.flush()


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")  # the replies' own descriptor; fd 1 becomes stderr's
    os.dup2(2, 1)
    for name in MODULES:
        importlib.import_module(f"eagle_train.{name}")
    for line in sys.stdin:
        if line.strip():
            run(json.loads(line), replies)


if __name__ == "__main__":
    main()
