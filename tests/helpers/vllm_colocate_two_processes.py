"""Run by tests/test_vllm_colocate.py under `accelerate launch` (2 CPU processes): train with
vllm_mode="colocate" (an engine in each process), then write what the test checks to a JSON file (main process).

    python tests/helpers/vllm_colocate_two_processes.py MODEL_PATH OUT.json
"""

import json
import sys

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from vllm import SamplingParams

from grpo import GRPOConfig, GRPOTrainer
from grpo.testing import tiny_tokenizer

PROMPT = [71, 68, 75, 75, 78]


def reward(prompts, completions, **kwargs):
    return [sum(ch.isalpha() for ch in c) / 10 for c in completions]


def main(model_path, out):
    args = GRPOConfig(
        output_dir=str(out) + ".run",
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=256,
        per_device_train_batch_size=2,  # x 2 processes = 1 group of 4 per micro-step, split 2 + 2
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
    backend = trainer.generation
    backend.sync_weights(policy, version=trainer.state.global_step)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, detokenize=False)
    output = backend.llm.generate([{"prompt_token_ids": PROMPT}], greedy, use_tqdm=False)[0]
    engine_greedy = list(output.outputs[0].token_ids)
    # The two halves of a split group, as the trainer samples them: each process its two rows.
    halves = gather_object([backend.generate(policy, [PROMPT, PROMPT]).ids])
    greedy_everywhere = gather_object([engine_greedy])
    if trainer.accelerator.is_main_process:
        policy.eval()
        with torch.no_grad():
            ids = torch.tensor([PROMPT])
            local = policy.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
        samples = [tuple(row) for half in halves for row in half]
        result = {
            "world_size": trainer.accelerator.num_processes,
            "log_history": trainer.state.log_history,
            "engine_greedy": greedy_everywhere,
            "trainer_greedy": local[0, len(PROMPT) :].tolist(),
            "split_group_samples_differ": len(set(samples)) == 4,
        }
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
