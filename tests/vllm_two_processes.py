"""Run by tests/test_vllm.py under `accelerate launch` (2 CPU processes): train with use_vllm=True against the
server on the port given, then write what the test checks to a JSON file (main process).

    python tests/vllm_two_processes.py MODEL_PATH PORT GROUP_PORT OUT.json
"""

import json
import sys

import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.testing import tiny_tokenizer


def reward(prompts, completions, **kwargs):
    return [sum(ch.isalpha() for ch in c) / 10 for c in completions]


def main(model_path, port, group_port, out):
    args = GRPOConfig(
        output_dir=str(out) + ".run",
        use_vllm=True,
        vllm_server_port=int(port),
        vllm_group_port=int(group_port),
        vllm_server_timeout=60,
        per_device_train_batch_size=4,  # x 2 processes = 2 groups of 4 per step
        num_generations=4,
        max_completion_length=12,
        max_steps=2,
        learning_rate=0.05,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
    )
    data = Dataset.from_dict({"prompt": ["hello there", "count to three", "abc", "xyz"] * 4})
    trainer = GRPOTrainer(model_path, reward, args=args, train_dataset=data, processing_class=tiny_tokenizer())
    trainer.train()
    policy = trainer.accelerator.unwrap_model(trainer.model)
    trainer.generation.sync_weights(policy, version=trainer.state.global_step)
    if trainer.accelerator.is_main_process:
        prompt = [71, 68, 75, 75, 78]
        reply = trainer.generation.client.generate([prompt], n=1, max_tokens=10, temperature=0.0, logprobs=False)
        policy.eval()
        with torch.no_grad():
            ids = torch.tensor([prompt])
            local = policy.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
        result = {
            "world_size": trainer.accelerator.num_processes,
            "log_history": trainer.state.log_history,
            "server_greedy": reply["completion_ids"][0],
            "trainer_greedy": local[0, len(prompt) :].tolist(),
        }
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
