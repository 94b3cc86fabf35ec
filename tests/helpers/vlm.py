"""Tiny vision-language runs for tests/test_vlm.py and tests/test_distributed.py: a data set of images of coloured
squares beside a chat prompt, a scripted sampler that takes vision inputs, and one plain-SGD step's update.

    accelerate launch --config_file tests/configs/accelerate_cpu_2proc.yaml tests/helpers/vlm.py OUT PER_DEVICE GA

saves the update of one step on 2 processes (tests/test_distributed.py compares it with 1 process)."""

import json
import os
import sys

import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.testing import squares_image, tiny_vlm
from tests.helpers.net import end_launched_process
from tests.helpers.scripted import TINY, ScriptedGeneration


def squares_dataset(num_rows: int = 8, column: str = "image") -> Dataset:
    """Rows asking how many squares an image shows: 1 to 4 squares, each row its own image (`images`: as a list of
    one)."""
    counts = [1 + i % 4 for i in range(num_rows)]
    images = [squares_image(n, seed=i) for i, n in enumerate(counts)]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Row {i}: how many squares?"}] for i in range(num_rows)],
            column: [[image] for image in images] if column == "images" else images,
            "answer": [str(n) for n in counts],
        }
    )


def reply_length(completions):
    """The length of each reply's text (the scripted completions differ in length within a group)."""
    return [float(len(completion[0]["content"])) for completion in completions]


class ScriptedVisionGeneration(ScriptedGeneration):
    """`ScriptedGeneration` for rows with images: the completions depend on the prompt tokens only."""

    def generate(self, model, prompt_ids, vision=None):
        assert vision is not None and len(vision) == len(prompt_ids)
        return super().generate(model, prompt_ids)


def vlm_step_update(output_dir, kind="idefics3", **config):
    """(update of every parameter, trainer) after one plain-SGD step of a tiny VLM of `kind` on scripted completions
    of `squares_dataset(16)`, with the KL term on (the reference sees the images too)."""
    model, processor = tiny_vlm(kind=kind)
    # G = 2: a step of 4 rows holds two prompts, so the two processes hold different images.
    settings = dict(max_steps=1, optim="sgd", learning_rate=0.5, max_grad_norm=0.0, shuffle_dataset=False, beta=0.04)
    settings["num_generations"] = 2
    args = GRPOConfig(output_dir=str(output_dir), **{**TINY, **settings, **config})
    trainer = GRPOTrainer(
        model, reply_length, args=args, train_dataset=squares_dataset(16), processing_class=processor
    )
    offset = trainer.accelerator.process_index * args.per_device_train_batch_size * args.steps_per_generation
    trainer.generation = ScriptedVisionGeneration(args.num_generations, args.max_completion_length, offset=offset)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}, trainer


def one_vlm_step(kind, per_device, accumulation, output_dir):
    """(update, number of processes, logged loss, parameters after the step, logged images): the last, the
    completions log's (prompt text, image paths, image file bytes) per row, the images logged by `log_multimodal`."""
    output_dir = os.path.join(output_dir, kind)
    update, trainer = vlm_step_update(
        output_dir, kind=kind, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        log_completions=True, num_completions_to_print=0,
    )  # fmt: skip
    params = {n: p.detach() for n, p in trainer.model.named_parameters()}
    loss = trainer.state.log_history[0]["loss"]
    return update, trainer.accelerator.num_processes, loss, params, logged_images(output_dir)


def logged_images(output_dir) -> list[tuple[str, list[str], list[bytes]]]:
    """Each completions.jsonl record's prompt text, image paths and the bytes of those files."""
    if not os.path.exists(os.path.join(output_dir, "completions.jsonl")):
        return []  # not the main process
    with open(os.path.join(output_dir, "completions.jsonl")) as f:
        records = [json.loads(line) for line in f]
    read = lambda path: open(os.path.join(output_dir, path), "rb").read()  # noqa: E731
    return [(r["prompt"][0]["content"], r["images"], [read(p) for p in r["images"]]) for r in records]


if __name__ == "__main__":
    out_file, per_device, accumulation = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    results = {
        kind: one_vlm_step(kind, per_device, accumulation, f"{out_file}.d") for kind in ("idefics3", "qwen2_vl")
    }
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        torch.save(results, out_file)
    end_launched_process()
