"""Model adapters: the frozen target (`target.py`), the EAGLE draft heads (`draft.py`, `eagle3.py`) and
their checkpoints (`head_checkpoint.py`), with the pure pieces they share (`logit_transform.py`,
`draft_vocab.py`)."""
