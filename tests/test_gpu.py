"""The training path on a CUDA device, where GPU users run it: bf16 by default, generation with the shared prompt
prefill, the float32 output head. These skip on a machine without CUDA (CI's); `pytest -m gpu tests` runs them
where there is one.

The first one was written after a GPU run of the suite found that `model.generate` with shared prompts built its
row index on the CPU and failed on every CUDA run: nothing on a CPU can see that."""

import math

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.generation.model_generate import shared_prompt_cache
from grpo.testing import tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("cast_lm_head_to_fp32", [False, True])
def test_a_bf16_run_on_cuda_trains_every_parameter(tmp_path, tiny_model_path, prompt_dataset, cast_lm_head_to_fp32):
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,  # two prompts x G=4: groups of identical prompts share their prefill
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        cast_lm_head_to_fp32=cast_lm_head_to_fp32,
        report_to="none",
        save_strategy="no",
    )
    assert args.bf16, "GRPOConfig turns bf16 on where CUDA supports it"
    trainer = GRPOTrainer(tiny_model_path, _reward_len, args=args, train_dataset=prompt_dataset)
    before = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert next(trainer.model.parameters()).device.type == "cuda"
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(before[n], p.detach().float())]
    assert not unchanged, unchanged
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(v) for v in losses)


def test_the_shared_prefill_on_cuda_holds_each_rows_own_cache():
    model = tiny_model().cuda().eval()
    ids = torch.tensor([[0, 5, 6, 7], [0, 5, 6, 7], [3, 4, 8, 9]], device="cuda")
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]], device="cuda")
    with torch.no_grad():
        shared = shared_prompt_cache(model, ids, mask, firsts=[0, 2], counts=[2, 1])
        alone = shared_prompt_cache(model, ids, mask, firsts=[0, 1, 2], counts=[1, 1, 1])
    assert shared is not None and alone is not None
    for layer in range(len(alone.layers)):
        torch.testing.assert_close(shared.layers[layer].keys, alone.layers[layer].keys)
        torch.testing.assert_close(shared.layers[layer].values, alone.layers[layer].values)
