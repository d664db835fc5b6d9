"""Model adapters: the frozen target (`target.py`) and the EAGLE draft head (`draft.py`)."""
