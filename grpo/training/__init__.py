"""Training: the trainer that sequences a step, and what it runs around it (asynchronous rounds, dynamic
sampling, checkpoints, the non-finite guard, metrics)."""
