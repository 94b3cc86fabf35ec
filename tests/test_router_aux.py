"""A Mixture-of-Experts model's load-balancing loss in the GRPO loss (`router_aux_loss_coef`,
grpo/objective/regularizers.py), on a tiny random Qwen2-MoE built here: the loss the log-prob pass collects is the
model's own `aux_loss`, and the trainer adds it times the weight."""

import pytest
import torch
from datasets import Dataset
from transformers import GenerationConfig, Qwen2MoeConfig, Qwen2MoeForCausalLM

from grpo import GRPOConfig, GRPOTrainer
from grpo.objective.logprobs import completion_logprobs
from grpo.objective.regularizers import router_aux_coef, router_aux_term
from grpo.testing import tiny_model


def tiny_moe(tokenizer, router_aux_loss_coef=0.02, seed=0):
    """2 layers of 4 experts (2 per token) and a shared expert, hidden size 64: Qwen2-MoE's layout, in miniature."""
    config = Qwen2MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=router_aux_loss_coef,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        experts_implementation="eager",  # a loop over the experts: runs in float64 too (grouped_mm does not)
    )
    torch.manual_seed(seed)
    model = Qwen2MoeForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id
    )
    return model


def _batch(pad_id):
    # Two groups of two rows (repeated prompts, as GRPO's are), left-padded prompts, right-padded completions.
    prompt_ids = torch.tensor([[pad_id, 5, 6], [pad_id, 5, 6], [7, 8, 9], [7, 8, 9]])
    completion_ids = torch.tensor(
        [[20, 21, 22, 23], [30, 31, pad_id, pad_id], [40, pad_id, pad_id, pad_id], [50, 51, 52, pad_id]]
    )
    return prompt_ids, (prompt_ids != pad_id).long(), completion_ids, (completion_ids != pad_id).long()


def _models_own_aux_loss(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    mask = torch.cat([prompt_mask, completion_mask], 1)
    output = model(
        input_ids=torch.cat([prompt_ids, completion_ids], 1),
        attention_mask=mask,
        position_ids=(mask.cumsum(1) - 1).clamp(min=0),
        output_router_logits=True,
    )
    return output.aux_loss


@pytest.mark.parametrize("padding_free", [False, True])
def test_the_log_prob_pass_collects_the_models_own_aux_loss(tokenizer, padding_free):
    """Value and gradient (float64) equal the model's own `aux_loss` over the whole padded batch, each prompt counted
    once per row; packed without padding, the same tokens give the same loss."""
    model = tiny_moe(tokenizer).double()
    batch = _batch(tokenizer.pad_token_id)
    aux_losses = []
    completion_logprobs(model, *batch, aux_losses=aux_losses, padding_free=padding_free)
    assert len(aux_losses) == 1
    router = [p for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")]
    (got,) = torch.autograd.grad(aux_losses[0], router[:1])
    want = _models_own_aux_loss(model, *batch)
    (want_grad,) = torch.autograd.grad(want, router[:1])
    torch.testing.assert_close(aux_losses[0], want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got, want_grad, rtol=0, atol=1e-12)
    assert want_grad.abs().max() > 0
    # Without a list nothing is collected, and the log-probs do not depend on it.
    plain, _ = completion_logprobs(model, *batch, padding_free=padding_free)
    collected, _ = completion_logprobs(model, *batch, aux_losses=[], padding_free=padding_free)
    torch.testing.assert_close(plain, collected, rtol=0, atol=1e-12)


def test_router_aux_term_is_the_weighted_mean_over_micro_steps():
    aux = [torch.tensor(1.5, dtype=torch.float64), torch.tensor(2.5, dtype=torch.float64)]
    term, stats = router_aux_term(aux, 0.1, micro_steps=4)
    assert term.item() == pytest.approx(0.1 * 2.0 / 4, abs=1e-15) and stats["aux_loss"].item() == 2.0
    assert router_aux_term(None, 0.1, 4) == (0.0, {}) and router_aux_term(aux, 0.0, 4) == (0.0, {})


def test_the_weight_is_the_models_own_unless_set(tokenizer):
    moe = tiny_moe(tokenizer, router_aux_loss_coef=0.03).config
    assert router_aux_coef(moe, None) == 0.03
    assert router_aux_coef(moe, 0.5) == 0.5 and router_aux_coef(moe, 0.0) == 0.0
    dense = tiny_model(tokenizer).config
    assert router_aux_coef(dense, None) == 0.0 and router_aux_coef(dense, 0.0) == 0.0
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.01 .* llama is not a MoE model .* Remove"):
        router_aux_coef(dense, 0.01)


def _args(tmp_path, **settings):
    return GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", logging_steps=1, save_strategy="no",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=1, learning_rate=1e-2,
        seed=3, disable_tqdm=True, **settings,
    )  # fmt: skip


def test_a_weight_on_a_dense_model_is_refused_when_the_trainer_is_built(tokenizer, tmp_path):
    dataset = Dataset.from_dict({"prompt": ["a", "b"]})
    with pytest.raises(ValueError, match="not a MoE model"):
        GRPOTrainer(
            tiny_model(tokenizer), lambda completions: [0.0] * len(completions), processing_class=tokenizer,
            args=_args(tmp_path, router_aux_loss_coef=0.01), train_dataset=dataset,
        )  # fmt: skip


@pytest.mark.slow
def test_the_trainer_adds_the_aux_loss_times_its_weight(tokenizer, tmp_path):
    """One step on the same samples with the weight 0 and 0.5: the logged losses differ by 0.5 x the logged
    `aux_loss`, and the default (None) takes the model's own weight."""
    dataset = Dataset.from_dict({"prompt": [f"Count {i}." for i in range(4)]})

    def train(name, **settings):
        trainer = GRPOTrainer(
            tiny_moe(tokenizer), lambda completions: [float(len(c) % 3) for c in completions],
            processing_class=tokenizer, args=_args(tmp_path / name, **settings), train_dataset=dataset,
        )  # fmt: skip
        trainer.train()
        return trainer, trainer.state.log_history[0]

    _, without = train("without", router_aux_loss_coef=0.0)
    _, weighted = train("weighted", router_aux_loss_coef=0.5)
    default, _ = train("default")
    assert "aux_loss" not in without and weighted["aux_loss"] > 0
    added = weighted["loss"] - without["loss"]
    assert added == pytest.approx(0.5 * weighted["aux_loss"], rel=1e-4)
    assert default.step_loss.router_coef == 0.02
