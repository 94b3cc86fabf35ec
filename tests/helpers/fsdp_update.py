"""GRPO under FSDP2 (torch `fully_shard`, accelerate's FSDP plugin version 2) on two CPU processes over gloo.

    ACCELERATE_TORCH_DEVICE=cpu accelerate launch --config_file tests/configs/accelerate_cpu_fsdp2.yaml \
        tests/helpers/fsdp_update.py OUT [--resume OUTPUT_DIR]
    ACCELERATE_USE_CPU=1 accelerate launch --config_file tests/configs/accelerate_cpu_fsdp2.yaml \
        tests/helpers/fsdp_update.py OUT --unpatched       # what accelerate picks by itself: MULTI_CPU (DDP)

Saves, for tests/test_fsdp.py: per loss type and with a LoRA adapter the parameters after 3 plain-SGD steps on
scripted completions (gathered whole), the logged losses and what really ran (distributed type, parameter class, how
the log-probs met the sharded output projection); per output-projection variant the log-probs and gradients of
`completion_logprobs` on a fixed batch per process, chunked with the gathered weight and through full logits; the
parameters of 3 Adam steps that save a checkpoint every step (with `--resume OUTPUT_DIR`: of the same run resumed from
its checkpoint-2); `checkpoint_tensors` of a freshly sharded model; the losses of a short run that samples with the
policy's own `model.generate`; and `generate` on processes that stop after different numbers of tokens.

accelerate 1.15 never selects FSDP on CPU: `PartialState._prepare_backend` gives CPU processes
`DistributedType.MULTI_CPU`, and `AcceleratorState` turns on the FSDP plugin only for the accelerator types
(MULTI_GPU, MULTI_XPU, ...), so the config's FSDP section is silently dropped and the processes run DDP (with
ACCELERATE_USE_CPU=1) or train alone (without). `route_fsdp_to_cpu` patches that one routing decision: the processes
report MULTI_GPU with the gloo backend, and ACCELERATE_TORCH_DEVICE=cpu keeps every tensor on the CPU. Everything after
it (fully_shard, the trainer, the optimizer, the gathers) is the unpatched code."""

import collections
import sys

import torch
from datasets import Dataset
from transformers import TrainerCallback

import grpo.objective.logprobs as logprobs
from grpo import GRPOConfig, GRPOTrainer
from grpo.data import pad
from grpo.generation.policy_weights import checkpoint_tensors
from grpo.objective.logprobs import _is_sharded, completion_logprobs
from grpo.testing import save_tiny_model, tiny_config, tiny_model, tiny_tokenizer
from tests.helpers.distributed_update import lora_config
from tests.helpers.net import end_launched_process
from tests.helpers.scripted import TINY, ScriptedGeneration, reward_len

LOSS_TYPES = ("grpo", "dapo")
STEPS = 3
# The checkpointed run: Adam, so that resuming needs the sharded optimizer state too; a checkpoint every step.
SAVED = dict(optim="adamw_torch", learning_rate=1e-2, save_strategy="steps", save_steps=1)


# Set by `route_fsdp_to_cpu`: this is one of the launched processes, not the test's own.
ROUTED = False


def route_fsdp_to_cpu():
    global ROUTED
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        return "gloo", DistributedType.MULTI_GPU

    PartialState._prepare_backend = prepare_backend
    ROUTED = True


# How completion_logprobs met the output projection's weight and bias after the forward, in this process:
# "gathered" counts DTensor shards gathered whole by `_whole`, "whole" tensors already whole (the root module of
# accelerate's FSDP2 wrapping keeps its parameters gathered from the forward to the backward), "full_logits" the
# calls of the full-logits fallback.
CALLS = collections.Counter()
# Log-prob passes in the grouped layout (each group's prompt once, grpo/objective/shared_prompt.py), in this process.
SHARED = collections.Counter()


def count_calls():
    gather, full_logits = logprobs._whole, logprobs._logprobs_from_full_logits

    def counted_gather(param, dtype):
        if param is not None:
            CALLS["gathered" if logprobs._is_dtensor(param) else "whole"] += 1
        return gather(param, dtype)

    def counted_full_logits(*args, **kwargs):
        CALLS["full_logits"] += 1
        return full_logits(*args, **kwargs)

    layout = logprobs.grouped_layout

    def counted_layout(*args, **kwargs):
        grouped = layout(*args, **kwargs)
        SHARED["passes"] += grouped is not None
        return grouped

    logprobs._whole, logprobs._logprobs_from_full_logits = counted_gather, counted_full_logits
    logprobs.grouped_layout = counted_layout


def whole(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()


def prompts(n=16):
    return Dataset.from_dict({"prompt": [f"Question {i}: count to three." for i in range(n)]})


class StepCounter(TrainerCallback):
    """Counts the optimizer steps this run took (a resumed run takes only the remaining ones)."""

    steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def trained(output_dir, per_device, scripted=True, lora=False, resume=None, model=None, rewards=reward_len, **config):
    """(parameters after training, trainer): plain SGD (no clipping, so a scale error shows), the KL term on (a frozen
    reference, or the adapter disabled with `lora`), STEPS optimizer steps; completions scripted unless `scripted` is
    False (then `model.generate`); from the checkpoint folder `resume` when given; the tiny model built in code, or
    loaded from the folder `model`; scored by `rewards`. `trainer.initial`: the parameters before training."""
    tokenizer = tiny_tokenizer()
    settings = dict(max_steps=STEPS, optim="sgd", learning_rate=0.5, max_grad_norm=0.0, shuffle_dataset=False)
    # TINY's use_cpu in the test's own process (the 1-process reference); off in the routed processes, which
    # ACCELERATE_TORCH_DEVICE=cpu keeps on the CPU: accelerate given cpu=True starts neither their process group nor
    # DeepSpeed (it checks `not cpu`).
    settings["use_cpu"] = not ROUTED
    args = GRPOConfig(
        output_dir=str(output_dir),
        **{**TINY, **settings, "beta": 0.04, "per_device_train_batch_size": per_device, **config},
    )
    torch.manual_seed(0)  # LoRA's A is drawn when the model is wrapped: the same on every process and every run
    trainer = GRPOTrainer(
        tiny_model(tokenizer) if model is None else model,
        rewards,
        args=args,
        train_dataset=prompts(),
        processing_class=tokenizer,
        peft_config=lora_config() if lora else None,
    )
    if scripted:
        offset = trainer.accelerator.process_index * args.generation_batch_size // args.world_size  # its first row
        trainer.generation = ScriptedGeneration(args.num_generations, args.max_completion_length, offset=offset)
    trainer.counter = StepCounter()
    trainer.add_callback(trainer.counter)
    trainer.initial = {n: whole(p) for n, p in trainer.model.named_parameters()}  # where the updates start
    trainer.train(resume_from_checkpoint=resume)
    return {n: whole(p) for n, p in trainer.model.named_parameters()}, trainer


def describe(trainer):
    """What really ran: the distributed type, the classes of the policy's and the reference's parameters, whether
    the log-probs see a sharded output projection and how they met it since the last call (`CALLS`), how many of
    their passes shared the prompt (`SHARED`), the process
    count, the steps taken and the logged losses."""
    reference = trainer.ref_model
    calls, shared = dict(CALLS), SHARED["passes"]
    CALLS.clear()
    SHARED.clear()
    return {
        "calls": calls,
        "shared_passes": shared,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "param_class": type(next(trainer.model.parameters())).__name__,
        "ref_param_class": None if reference is None else type(next(reference.parameters())).__name__,
        "head_sharded": _is_sharded(trainer.model.get_output_embeddings().weight),
        "world_size": trainer.accelerator.num_processes,
        "steps_run": trainer.counter.steps,
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "rewards": [entry["reward"] for entry in trainer.state.log_history if "reward" in entry],
    }


def sharded_checkpoint_tensors():
    """(checkpoint_tensors of the tiny model sharded by accelerate's FSDP2 preparation, of the same model unwrapped,
    the class of the sharded parameters, the local shard's rows of the embedding)."""
    from accelerate import Accelerator

    tokenizer = tiny_tokenizer()
    plain = dict(checkpoint_tensors(tiny_model(tokenizer)))
    accelerator = Accelerator()
    model = tiny_model(tokenizer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    embedding = model.get_input_embeddings().weight
    sharded = dict(checkpoint_tensors(model))
    return {
        "plain": plain,
        "sharded": sharded,
        "class": type(embedding).__name__,
        "rows": embedding.to_local().shape[0],
    }


def uneven_generate():
    """[(new tokens, sum over processes of rank + 1 taken right after)] per process, when process r's `generate`
    on the sharded model stops after 2 + 4 r tokens (as when one process's rows all reach EOS first). Each decoding
    step all-gathers the shards, so a process that stops early must keep joining the others' steps (transformers
    turns `synced_gpus` on for modules `fully_shard` marks); otherwise this hangs or the sum is wrong."""
    from accelerate import Accelerator

    accelerator = Accelerator()
    model = tiny_model(tiny_tokenizer())
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rank = accelerator.process_index
    ids = torch.tensor([[5, 6, 7]])
    new = 2 + 4 * rank
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
    total = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(total)
    everyone = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(everyone, (out.shape[1] - ids.shape[1], total.item()))
    return everyone


HEADS = ("untied", "tied", "bias")  # output projections: its own weight, the embedding's, with a bias (Phi)


def head_variant(kind):
    """The tiny model with output projection `kind` (one of HEADS), the same initial weights on every process."""
    torch.manual_seed(0)
    if kind == "bias":
        import transformers

        base = tiny_config(tiny_tokenizer())
        names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        config = {name: getattr(base, name) for name in (*names, "num_key_value_heads")}
        return transformers.PhiForCausalLM(transformers.PhiConfig(**config))
    return tiny_model(tiny_tokenizer(), tie_word_embeddings=kind == "tied")


def logprob_batch(rank):
    """Process `rank`'s batch for `sharded_logprobs`: 3 rows, prompts left-padded, ragged completions right-padded
    (one row ends with EOS 258), different on each process. Pad id 256."""
    prompts = [[5 + rank, 6, 7, 8, 9], [10, 11 + rank], [12, 13, 14]]
    completions = [[20, 21 + rank, 258], [30, 31, 32, 33 + rank, 34], [40 + rank]]
    return (*pad(prompts, 256, "left"), *pad(completions, 256, "right"))


def logprob_loss(logps, completion_mask):
    """A loss whose gradient weights every completion token differently (a sum would hide a transposed row)."""
    weights = torch.arange(1, logps.numel() + 1, dtype=logps.dtype).view(logps.shape) / logps.numel()
    return (logps * weights * completion_mask).sum()


def head_as_own_unit(model, kind):
    """`fully_shard` by hand as torchtitan does it: each decoder layer, the output projection (with the embedding
    when tied: one group), then the root. The projection's group gathers for its own forward and shards again
    after it, so completion_logprobs finds a DTensor and gathers it itself."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard([model.get_input_embeddings(), model.lm_head] if kind == "tied" else model.lm_head, mesh=mesh)
    return fully_shard(model, mesh=mesh)


LAYOUTS = ("accelerate", "head_unit")  # accelerate's FSDP2 preparation (the trainer's), `head_as_own_unit`


def sharded_logprobs():
    """Per output-projection variant (HEADS), layout (LAYOUTS) and path ("chunked": completion_logprobs as the
    trainer calls it; "full_logits": its fallback forced): (every process's log-probs and entropies of its
    `logprob_batch` at temperature 0.7, the gradients of `logprob_loss` gathered whole, CALLS). FSDP2 averages
    gradients over the processes, so they must equal the mean of each process's gradient on one unsharded model."""
    from accelerate import Accelerator

    accelerator = Accelerator()
    rank = accelerator.process_index
    results = {}
    for kind in HEADS:
        for layout in LAYOUTS:
            model = head_variant(kind)
            if layout == "head_unit":
                model = head_as_own_unit(model, kind)
            else:  # the plugin keeps the layer class an earlier trainer named (LlamaDecoderLayer): take the model's
                accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = None
                model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            batch = logprob_batch(rank)
            for path in ("chunked", "full_logits"):
                CALLS.clear()
                if path == "chunked":
                    logps, entropy = completion_logprobs(model, *batch, temperature=0.7, with_entropy=True)
                else:
                    logps, entropy = logprobs._logprobs_from_full_logits(model, *batch, 0.7, True)
                logprob_loss(logps, batch[3]).backward()
                grads = {name: whole(param.grad) for name, param in model.named_parameters()}
                model.zero_grad()
                everyone = [None] * accelerator.num_processes
                torch.distributed.all_gather_object(everyone, (logps.detach(), entropy))
                results[kind, layout, path] = (everyone, grads, dict(CALLS))
            accelerator.free_memory()
    return results


def unpatched_distributed_type():
    """The distributed type accelerate itself picks for the FSDP2 config on CPU (no `route_fsdp_to_cpu`)."""
    from accelerate import Accelerator

    return str(Accelerator().distributed_type)


if __name__ == "__main__":
    out_file = sys.argv[1]
    if sys.argv[2:] == ["--unpatched"]:
        kind = unpatched_distributed_type()
        if torch.distributed.get_rank() == 0:
            torch.save(kind, out_file)
        end_launched_process()
    route_fsdp_to_cpu()
    count_calls()
    results = {}
    if sys.argv[2:3] == ["--resume"]:  # OUT --resume OUTPUT_DIR: the saved run again, from its checkpoint-2
        params, trainer = trained(sys.argv[3], 4, resume=f"{sys.argv[3]}/checkpoint-2", **SAVED)
        results["resumed"] = (params, describe(trainer))
    else:
        for loss_type in LOSS_TYPES:
            params, trainer = trained(f"{out_file}.d", 4, loss_type=loss_type)
            results[loss_type] = (params, describe(trainer))
        # The dapo run from a folder, the way users pass a model (from_pretrained, the reference a copy of it).
        if torch.distributed.get_rank() == 0:
            save_tiny_model(f"{out_file}.model")
        torch.distributed.barrier()
        params, trainer = trained(f"{out_file}.p", 4, model=f"{out_file}.model", loss_type="dapo")
        results["from_path"] = (params, describe(trainer))
        params, trainer = trained(f"{out_file}.l", 4, lora=True)
        results["lora"] = (params, describe(trainer))
        params, trainer = trained(f"{out_file}.c", 4, **SAVED)
        results["saved"] = (params, describe(trainer))
        results["checkpoint_tensors"] = sharded_checkpoint_tensors()
        _, trainer = trained(f"{out_file}.g", 4, scripted=False, max_steps=2)
        results["generate"] = describe(trainer)
        results["uneven_generate"] = uneven_generate()
        results["logprobs"] = sharded_logprobs()
    if torch.distributed.get_rank() == 0:
        torch.save(results, out_file)
    end_launched_process()
