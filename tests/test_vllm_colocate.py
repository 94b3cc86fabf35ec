"""`vllm_mode="colocate"`: a real vLLM engine (vLLM's CPU build) inside the test process, and inside each of two
trainer processes under `accelerate launch`.

Runs in the vLLM environment: `make test-vllm`. An engine on the tiny model starts in about 3 s once vLLM is imported.
"""

import json
import re
import types
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

pytest.importorskip("vllm", reason="needs vLLM: run `make test-vllm`")

from vllm import SamplingParams  # noqa: E402

from grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo.generation import cut_at_eos  # noqa: E402
from grpo.generation.vllm.colocate import VLLMColocateGeneration  # noqa: E402
from grpo.testing import save_tiny_model  # noqa: E402
from tests.helpers.agents import talkative_add_trainer, talkative_agent_trainer  # noqa: E402
from tests.helpers.net import launch_two_processes  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT = [71, 68, 75, 75, 78]  # five byte tokens
TOKENS = 10
ONE_PROCESS = types.SimpleNamespace(process_index=0, local_process_index=0, num_processes=1)


@pytest.fixture(scope="module", autouse=True)
def cpu_engine_settings():
    # A 1 GiB KV cache per engine (vLLM's CPU default is larger than this machine wants for a tiny model).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        yield


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def _greedy(model, prompt=PROMPT, tokens=TOKENS):
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _engine_greedy(llm, prompt=PROMPT, tokens=TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=tokens, detokenize=False)
    return list(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_greedy_outputs_match_model_generate_before_and_after_a_sync(model_path):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    # The stop token is one the greedy completion emits, so that stopping is checked too.
    eos = _greedy(model)[3]
    backend = VLLMColocateGeneration(
        ONE_PROCESS,
        eos_token_ids=[eos],
        max_completion_length=TOKENS,
        temperature=0.0,  # greedy: the config refuses 0, the backend passes it to vLLM as is
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        engine_kwargs={"max_model_len": 256},
    )
    with pytest.raises(RuntimeError, match="sync_weights before generate"):
        backend.generate(model, [PROMPT])
    backend.sync_weights(model, version=0)
    other = [5, 6, 7]
    before = backend.generate(model, [PROMPT, other])
    expected, _ = cut_at_eos([_greedy(model), _greedy(model, other)], [eos], TOKENS)
    assert before.ids == expected and before.ids[0][-1] == eos
    assert [len(row) for row in before.logprobs] == [len(row) for row in before.ids]

    # New weights reach the engine only with a new version.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    backend.sync_weights(model, version=0)
    assert backend.generate(model, [PROMPT, other]).ids == before.ids
    backend.sync_weights(model, version=1)
    after = backend.generate(model, [PROMPT, other])
    expected, _ = cut_at_eos([_greedy(model), _greedy(model, other)], [eos], TOKENS)
    assert after.ids == expected and after.ids != before.ids

    # Sampling: a group split into runs (G = 4 here, 3 rows then 1 after another prompt) gets one row per input
    # row, in order, with distinct samples within a run and fresh samples at every call.
    backend.sampling["temperature"] = 1.0
    backend.sampling["stop_token_ids"] = []
    rows = [PROMPT] * 3 + [other] + [PROMPT]
    first = backend.generate(model, rows)
    assert len(first.ids) == 5 and all(len(ids) == TOKENS for ids in first.ids)
    assert len({tuple(ids) for ids in first.ids[:3]}) == 3
    assert backend.generate(model, rows).ids != first.ids
    assert all(lp <= 0 for row in first.logprobs for lp in row)

    # A PEFT model: its LoRA deltas merged into the base weights the engine holds.
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    peft_model = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    backend.sync_weights(peft_model, version=2)
    assert _engine_greedy(backend.llm) == _greedy(peft_model.merge_and_unload())


def _dataset():
    return Dataset.from_dict({"prompt": ["hello there", "count to three", "abc", "xyz"] * 4})


def _reward(prompts, completions, **kwargs):
    # Rewards letters, so that groups have a spread and the steps move the weights.
    return [sum(ch.isalpha() for ch in c) / 10 for c in completions]


def _training_config(output_dir, **overrides):
    settings = dict(
        output_dir=str(output_dir),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=256,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        # A large step so that one update visibly changes the greedy completion of the tiny random model.
        learning_rate=0.05,
        logging_steps=1,
        report_to=[],
    )
    return GRPOConfig(**{**settings, **overrides})


def test_training_with_a_colocated_engine(model_path, tokenizer, tmp_path):
    # Two steps: the second round is sampled after a sync, so its log-probs show the engine had the new weights.
    args = _training_config(tmp_path / "out", max_steps=2, save_strategy="no")
    trainer = GRPOTrainer(str(model_path), _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer)
    assert isinstance(trainer.generation, VLLMColocateGeneration)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    start = _greedy(policy)
    trainer.train()
    assert trainer.generation.synced_version == 1  # step 1's weights sampled the second round

    # The engine's log-probs of its samples match the trainer's (float32 on both sides) at both steps.
    steps = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    assert len(steps) == 2
    for logs in steps:
        assert logs["sampling/sampling_logp_difference/max"] < 1e-3
        assert abs(logs["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3

    # After the last step and a sync, the engine generates like the trained model, which moved.
    trainer.generation.sync_weights(policy, version=trainer.state.global_step)
    trained = _greedy(policy)
    assert _engine_greedy(trainer.generation.llm) == trained and trained != start


def test_async_generation_with_a_colocated_engine(model_path, tokenizer, tmp_path):
    """The producer thread samples on this process's engine while the trainer trains; loads wait for the engine."""
    args = _training_config(tmp_path / "out", max_steps=3, save_strategy="no", async_generation=True)
    trainer = GRPOTrainer(str(model_path), _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "async/staleness" in h]
    assert [h["async/staleness"] for h in logs] == [0, 1, 1]
    differences = [h["sampling/sampling_logp_difference/max"] for h in logs]
    assert differences[0] < 1e-3 < max(differences[1:])  # the engine's log-probs: the behaviour policy
    policy = trainer.accelerator.unwrap_model(trainer.model)
    trainer.generation.sync_weights(policy, version=trainer.state.global_step)
    trainer.generation.wait_for_load()  # with one process the engine loads in a thread of its own
    assert _engine_greedy(trainer.generation.backend.llm) == _greedy(policy)


def test_a_regex_constrains_every_completion_of_a_colocated_engine(model_path, tokenizer, tmp_path):
    # The engine loads the tokenizer for it (skip_tokenizer_init otherwise); the tiny random model never writes this
    # pattern on its own.
    pattern, seen = "(yes|no)[0-9]{2}", []

    def record(prompts, completions, **kwargs):
        seen.extend(completions)
        return [float(c.startswith("yes")) for c in completions]

    args = _training_config(tmp_path / "out", max_steps=1, save_strategy="no", vllm_structured_outputs_regex=pattern)
    GRPOTrainer(str(model_path), record, args=args, train_dataset=_dataset(), processing_class=tokenizer).train()
    assert len(seen) == 8 and all(re.fullmatch(pattern, c) for c in seen), seen


def test_a_resumed_run_samples_what_the_uninterrupted_one_did(model_path, tokenizer, tmp_path):
    # Building the engine seeds torch's generator with vLLM's `seed`; the backend puts the trainer's state back, so
    # the resumed run (whose engine is built after the checkpoint's generator state is restored) draws the same
    # per-call seeds, hence the same samples and losses.
    def run(out, resume=None):
        args = _training_config(out, max_steps=3, save_strategy="steps", save_steps=1)
        trainer = GRPOTrainer(
            str(model_path), _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer
        )
        trainer.train(resume_from_checkpoint=resume)
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-1"))
    assert len(full) == 3 and resumed == full


def test_two_trainer_processes_each_with_an_engine(model_path, tmp_path):
    out = tmp_path / "result.json"
    launch_two_processes(Path(__file__).parent / "helpers" / "vllm_colocate_two_processes.py", model_path, out)
    outcome = json.loads(out.read_text())
    assert outcome["world_size"] == 2
    # Both engines hold the trained weights.
    assert outcome["engine_greedy"] == [outcome["trainer_greedy"]] * 2
    # Every group of 4 was split 2 + 2 across the processes; each process sampled its rows with its own seeds.
    assert outcome["split_group_samples_differ"]
    steps = [h for h in outcome["log_history"] if "sampling/sampling_logp_difference/max" in h]
    assert len(steps) == 2 and all(h["sampling/sampling_logp_difference/max"] < 1e-3 for h in steps)


def test_multi_turn_episodes_with_a_colocated_engine(tokenizer, tmp_path):
    """As on the server (tests/test_vllm.py): three policy turns and two tool answers per episode, sampled by this
    process's engine, whose log-probs of the policy's tokens equal the trainer's."""
    args = _training_config(
        tmp_path / "out",
        max_steps=1,
        save_strategy="no",
        max_completion_length=240,
        max_prompt_length=None,
        max_tool_calling_iterations=2,
        vllm_max_model_length=1024,  # the tools' schemas make long prompts in byte tokens
    )
    trainer = talkative_add_trainer(tmp_path, args)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["tools/turns"] == 3 and logs["tools/call_frequency"] == 2
    assert logs["sampling/sampling_logp_difference/max"] < 1e-3


def test_agent_func_episodes_with_a_colocated_engine(tmp_path):
    """An agent program's two calls per episode (tests/helpers/agents.py `again_agent`), served by the endpoint from
    this process's engine: they merge into one trained sequence whose sampled tokens are the engine's (its log-probs
    of them equal the trainer's)."""
    args = _training_config(
        tmp_path / "out", max_steps=1, save_strategy="no", max_completion_length=64, max_prompt_length=None
    )
    trainer = talkative_agent_trainer(tmp_path, args)
    assert isinstance(trainer.generation, VLLMColocateGeneration)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["tools/turns"] == 2 and logs["tools/sequences"] == 1 and logs["tools/agent_failures"] == 0
    assert logs["sampling/sampling_logp_difference/max"] < 1e-3
