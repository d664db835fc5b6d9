"""The pieces of the training stage: data plans and collation, optimizer and schedule, checkpoints."""
