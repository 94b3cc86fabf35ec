"""Deterministic runs for tests that compare parameter updates across batch layouts and process counts.

`ScriptedGeneration`: completion k of a group (k = global row index mod G) depends only on the prompt and k: ragged
lengths, and the last copy of every group never emits EOS (truncated). `offset` is the global index of this
process's first row. `sgd_step_update` trains one plain-SGD step on such completions."""

from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer, StepRewards, process_reward
from grpo.generation import Completions
from grpo.testing import tiny_model, tiny_tokenizer

EOS = 258

# Tiny settings keep each run to a second or two: 8-token completions and G = 4. CPU float32 on every machine:
# the tests compare updates within float32's rounding (compare.py) and with tensors built on the CPU, and on a machine
# with a GPU GRPOConfig would pick CUDA and bf16 (its bf16=None default).
TINY = dict(
    use_cpu=True,
    bf16=False,
    report_to="none",
    max_completion_length=8,
    num_generations=4,
    per_device_train_batch_size=4,
    logging_steps=1,
    save_strategy="no",
    disable_tqdm=True,
)


class ScriptedGeneration:
    def __init__(self, num_generations, max_completion_length, offset=0):
        self.num_generations = num_generations
        self.max_completion_length = max_completion_length
        self.offset = offset

    def sync_weights(self, model, version):
        pass  # the completions do not depend on the weights

    def generate(self, model, prompt_ids):
        out = []
        for i, prompt in enumerate(prompt_ids):
            k = (self.offset + i) % self.num_generations
            seed = sum(prompt) + 31 * k
            if k == self.num_generations - 1:
                out.append([(seed + j) % 200 + 32 for j in range(self.max_completion_length)])
            else:
                out.append([(seed + 7 * j) % 200 + 32 for j in range(1 + k % 5)] + [EOS])
        return Completions(out)


def reward_len(prompts, completions):
    return [float(len(completion)) for completion in completions]


@process_reward
def len_as_final_step(completions, completion_ids):
    """reward_len as a process reward: one step, ending at the last token."""
    return [StepRewards([float(len(c))], token_ends=[len(ids) - 1]) for c, ids in zip(completions, completion_ids)]


def half_flat_dataset(num_prompts=32):
    """Prompts whose `flat` column is True (even index) get a constant reward from `half_flat_reward`."""
    return Dataset.from_dict(
        {
            "prompt": [f"Question {i}: count to three." for i in range(num_prompts)],
            "flat": [i % 2 == 0 for i in range(num_prompts)],
        }
    )


def half_flat_reward(completions, flat):
    return [1.0 if f else float(len(c)) for c, f in zip(completions, flat)]


def sgd_step_update(output_dir, reward_funcs=reward_len, dataset=None, captured=None, **config):
    """(parameter update, trainer) after one plain-SGD optimizer step on scripted completions of 16 fixed prompts
    (or `dataset`). No gradient clipping, so any scale error in the loss shows up in the update (Adam would hide
    it). `captured`: a list that receives every micro-batch the loss took."""
    tokenizer = tiny_tokenizer()
    if dataset is None:
        dataset = Dataset.from_dict({"prompt": [f"Question {i}: count to three." for i in range(16)]})
    settings = dict(max_steps=1, optim="sgd", learning_rate=0.5, max_grad_norm=0.0, shuffle_dataset=False)
    args = GRPOConfig(output_dir=str(output_dir), **{**TINY, **settings, **config})
    trainer = GRPOTrainer(
        tiny_model(tokenizer), reward_funcs, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    rows_per_process = args.per_device_train_batch_size * args.steps_per_generation
    offset = trainer.accelerator.process_index * rows_per_process
    use_sampler(trainer, ScriptedGeneration(args.num_generations, args.max_completion_length, offset=offset))
    if captured is not None:
        capture_batches(trainer, captured)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}, trainer


def use_sampler(trainer, backend):
    """Make `backend` the trainer's sampler; under async generation, the one inside its shared engine."""
    if trainer.args.async_generation:
        trainer.generation.backend = backend
    else:
        trainer.generation = backend


def capture_batches(trainer, captured=None):
    """Record every micro-batch that reaches compute_loss in the list `captured` (a new one by default), returned."""
    captured = [] if captured is None else captured
    original = trainer.compute_loss

    def capture(model, inputs, **kwargs):
        captured.append(inputs)
        return original(model, inputs, **kwargs)

    trainer.compute_loss = capture
    return captured
