"""Checks of what only an accelerator shows, as functions `scripts/gpu_check.py` and the `gpu` tests call
(gpu_checks.py); they also run small on a CPU."""
