"""The objective: group advantages, the clipped loss with its KL term and aggregation (`loss`), the per-token
log-probs it reads (`logprobs`), and the reference policy the KL term is taken against (`reference`)."""
