"""Tuning for CPU training on one kind of machine; each part is opt-in (docs/performance.md says what each gives)."""
