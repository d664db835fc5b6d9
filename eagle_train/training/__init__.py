"""The training stage's pieces: the loss and its held-out metrics (loss, metrics, ttt: EAGLE-3's
training-time test), data plans and collation, optimizer and schedule, run checkpoints and resume."""
