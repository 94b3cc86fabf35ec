"""Generation with vLLM: the `grpo vllm-serve` server, the trainer's client and backend for it, the colocated
engine, and the weight sync (full weights or a LoRA adapter)."""
