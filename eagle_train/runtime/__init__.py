"""How a process meets the operating system: atomic file writes, the output lock, the memory allocator.

atomic_files.py   the one home of file writes: atomic, ordinary permissions, sha256, temporary names and
                  their cleanup, JSON metadata read with errors naming the file
output_lock.py    the one lock on a stage's output (flock beside it, holder named, taken over after a kill)
allocator.py      glibc's mmap threshold fixed for CPU training (freed tensors leave the resident set)

Standard library only: every layer may call it.
"""
