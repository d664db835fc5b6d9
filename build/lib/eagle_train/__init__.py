"""eagle-train: train and evaluate EAGLE speculative-decoding draft heads for Hugging Face causal LMs."""

__version__ = "0.1.0"
