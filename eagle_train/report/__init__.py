"""The evaluation report: tables, sanity checks and plots over answer records, written as report.md,
report.json and PNGs.

results.py         the results table (tau, tokens/s, speedup, acceptance by position, greedy identity),
                   its sanity checks, plots and the writer
engine_section.py  the built-in decoder and a real vLLM side by side (evaluate engine=vllm)
shape_section.py   the decode shapes chosen and measured (decode.shape=auto), cost curves
"""
