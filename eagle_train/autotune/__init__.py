"""The decode-shape tuner (`decode.shape=auto`, `decode.tree=auto`): it times this machine and caches what
it measured, so it sits above the pure decoder it drives.

budget.py   the share of the evaluation the tuning may take, split among its parts
costs.py    a round's measured cost curves (target forward by width, draft steps), cached per key
replay.py   every shape's accepted length on calibration prompts, replayed from one drafting pass
shapes.py   acceptance x costs: the fastest chain length, EAGLE-2 shape and EAGLE-1 tree here
"""
