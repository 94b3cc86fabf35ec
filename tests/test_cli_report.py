"""What `grpo train` reports about the held-out prompts (greedy accuracy beside the sampled reward) and which panels
`grpo plot` draws, on the tiny model (grpo.testing) and hand-written log histories."""

import logging
import math
import os

import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer, StepRewards, process_reward
from grpo.cli import _quiet_deepspeed_on_cpu, before_after_report, evaluate_held_out, greedy_metrics, greedy_samples
from grpo.cli.plot import panels, split_history
from grpo.rewards import completion_text
from tests.helpers.scripted import TINY


def even_length(completions, **kwargs):
    """1 for a completion of even length: a deterministic function of the text, so it can be checked afterwards."""
    return [float(len(completion_text(c)) % 2 == 0) for c in completions]


def has_a(completions, **kwargs):
    return [float("a" in completion_text(c)) for c in completions]


def make_trainer(tmp_path, model_path, rows=6):
    held_out = Dataset.from_dict({"prompt": [f"Question {i}: count to three." for i in range(rows)]})
    # Eval batches of 4 rows: 6 held-out rows take two batches, the second one short.
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_eval_batch_size=4, reward_weights=[1.0, 0.5], **TINY
    )
    trainer = GRPOTrainer(model_path, [even_length, has_a], args=args, train_dataset=held_out, eval_dataset=held_out)
    return trainer, held_out


def test_greedy_samples_cover_every_row_and_carry_their_rewards(tmp_path, tiny_model_path):
    trainer, held_out = make_trainer(tmp_path, tiny_model_path)
    samples = greedy_samples(trainer, held_out)
    assert [s["prompt"] for s in samples] == held_out["prompt"]  # every row once, in order, across two batches
    for s in samples:
        expected = [even_length([s["completion"]])[0], has_a([s["completion"]])[0]]
        assert s["rewards"] == expected
        assert s["reward"] == expected[0] + 0.5 * expected[1]  # the weighted sum, as the trainer's `reward`
        assert s["outcome"] == s["reward"]  # every function is an outcome function
    # Greedy: the same completions again (a sampler at temperature 1 would not repeat 6 random completions).
    assert [s["completion"] for s in greedy_samples(trainer, held_out)] == [s["completion"] for s in samples]
    assert [s["completion"] for s in greedy_samples(trainer, held_out, count=2)] == [
        s["completion"] for s in samples[:2]
    ]


def test_greedy_metrics_by_hand():
    samples = [{"reward": r} for r in (1.0, 0.0, 1.5, math.nan, 0.5)]
    # Reward >= 1 on 2 of 5 prompts (NaN is not correct); mean reward (1 + 0 + 1.5 + 0.5) / 5 = 0.6, NaN as 0.
    assert greedy_metrics(samples) == {"eval_greedy_accuracy": 0.4, "eval_greedy_reward": 0.6}
    assert greedy_metrics([]) == {}


@process_reward
def whole_text_step(completions, **kwargs):
    """One step, the whole completion, worth 2: enough alone to lift any total reward to 1 or more."""
    return [StepRewards([2.0], char_ends=[len(completion_text(c))]) for c in completions]


def even_question(prompts, **kwargs):
    """1 for the even-numbered questions ("Question 4: ..."): right and wrong answers side by side, whatever is decoded."""
    return [float(int(p.split()[1].rstrip(":")) % 2 == 0) for p in prompts]


def test_greedy_accuracy_counts_the_outcome_reward_only(tmp_path, tiny_model_path):
    # Step (and turn) scores say how an answer was reached, not whether it is right: with a process function that
    # pays 2 for anything, every total is >= 1, but a greedy answer is right only when the outcome function pays 1.
    held_out = Dataset.from_dict({"prompt": [f"Question {i}: count to three." for i in range(6)]})
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_eval_batch_size=4, **TINY)
    trainer = GRPOTrainer(
        tiny_model_path, [even_question, whole_text_step], args=args, train_dataset=held_out, eval_dataset=held_out
    )
    samples = greedy_samples(trainer, held_out)
    assert [s["outcome"] for s in samples] == [1.0, 0.0] * 3
    assert [s["reward"] for s in samples] == [3.0, 2.0] * 3
    assert greedy_metrics(samples)["eval_greedy_accuracy"] == 0.5


def test_greedy_tool_use_counts_episodes_with_a_well_formed_call():
    call = {"role": "assistant", "content": "<tool_call>...</tool_call>", "tool_calls": [{"type": "function"}]}
    used = [call, {"role": "tool", "content": "408"}, {"role": "assistant", "content": "408"}]
    # A malformed call is answered with an error but carries no `tool_calls`: a parse failure, not a use of a tool.
    malformed = [{"role": "assistant", "content": "<tool_call>{</tool_call>"}, {"role": "tool", "content": "Error"}]
    plain = [{"role": "assistant", "content": "408"}]
    samples = [{"reward": 1.0, "completion": c} for c in (used, malformed, plain, used)]
    assert greedy_metrics(samples, tools=True)["eval_greedy_tool_use"] == 0.5  # 2 of 4
    assert "eval_greedy_tool_use" not in greedy_metrics(samples)  # no tools: no such metric


def test_evaluate_held_out_logs_greedy_accuracy_beside_eval_reward(tmp_path, tiny_model_path):
    trainer, held_out = make_trainer(tmp_path, tiny_model_path)
    metrics, samples = evaluate_held_out(trainer, held_out)
    assert len(samples) == len(held_out)
    assert "eval_reward" in metrics
    assert metrics["eval_greedy_accuracy"] == sum(s["reward"] >= 1 for s in samples) / len(samples)
    logged = [h for h in trainer.state.log_history if "eval_greedy_accuracy" in h]
    assert len(logged) == 1 and logged[0]["step"] == 0
    assert logged[0]["eval_greedy_accuracy"] == metrics["eval_greedy_accuracy"]


def sample(prompt, completion, rewards):
    return {"prompt": prompt, "completion": completion, "rewards": rewards, "reward": sum(rewards)}


def test_report_shows_greedy_accuracy_and_the_mean_only_for_non_binary_rewards():
    before = {"eval_reward": 0.25, "eval_greedy_accuracy": 0.5, "eval_greedy_reward": 0.5}
    after = {"eval_reward": 0.75, "eval_greedy_accuracy": 1.0, "eval_greedy_reward": 1.0}
    old = [sample("2 + 2", "4", [1.0]), sample("1 + 1", "3", [0.0])]
    new = [sample("2 + 2", "4", [1.0]), sample("1 + 1", "2", [1.0])]
    report = before_after_report(before, after, old, new, ["exact"], shown=1)
    greedy_line = next(line for line in report.splitlines() if line.startswith("eval_greedy_accuracy"))
    assert greedy_line.split()[1:] == ["0.500", "1.000", "+0.500"]
    assert "eval_greedy_reward" not in report  # 0/1 rewards: the mean is the accuracy
    partial = [sample("2 + 2", "4", [1.0]), sample("1 + 1", "2", [0.5])]
    assert "eval_greedy_reward" in before_after_report(before, after, old, partial, ["exact"])


def test_report_counts_greedy_changes_and_shows_the_changed_prompts_first():
    # Rows 0 and 3 stay right, row 1 turns right, row 2 turns wrong, row 4 stays wrong.
    old = [sample(f"q{i}", f"old{i}", [r]) for i, r in enumerate([1.0, 0.0, 1.0, 1.0, 0.0])]
    new = [sample(f"q{i}", f"new{i}", [r]) for i, r in enumerate([1.0, 1.0, 0.0, 1.0, 0.0])]
    report = before_after_report({}, {}, old, new, ["exact"], shown=3)
    assert "greedy answers of the 5 prompts: 1 turned right, 1 turned wrong, 2 right before and after, " in report
    assert "1 wrong before and after" in report
    shown = [line.removeprefix("prompt: ") for line in report.splitlines() if line.startswith("prompt: ")]
    assert shown == ["q1", "q2", "q0"]  # the two that changed, in data order, then the first of the rest
    assert "before (0.00): old1" in report and "after  (1.00): new1" in report
    # Resumed (nothing before training): the first prompts after, without counts.
    resumed = before_after_report(None, {}, [], new, ["exact"], shown=2)
    assert "greedy answers" not in resumed and "before (" not in resumed
    assert [line for line in resumed.splitlines() if line.startswith("prompt: ")] == ["prompt: q0", "prompt: q1"]


def test_report_shows_the_share_of_greedy_answers_cut_at_the_limit():
    # 3 of 4 greedy answers cut before the fix, 1 of 4 after: the table says so, beside the sampled cut share.
    old = [sample(f"q{i}", "6 + 4 = 10 The", [1.0]) | {"cut": i < 3} for i in range(4)]
    new = [sample(f"q{i}", "6 + 4 = 10", [1.0]) | {"cut": i < 1} for i in range(4)]
    before = {"eval_completions/clipped_ratio": 0.8, **greedy_metrics(old)}
    after = {"eval_completions/clipped_ratio": 0.2, **greedy_metrics(new)}
    assert (before["eval_greedy_clipped_ratio"], after["eval_greedy_clipped_ratio"]) == (0.75, 0.25)
    report = before_after_report(before, after, old, new, ["x"])
    rows = {line.split()[0]: line.split()[1:] for line in report.splitlines() if line.strip()}
    assert rows["eval_greedy_clipped_ratio"] == ["0.750", "0.250", "-0.500"]
    assert rows["eval_completions/clipped_ratio"] == ["0.800", "0.200", "-0.600"]


def test_greedy_samples_say_which_answers_were_cut(tmp_path, tiny_model_path):
    trainer, held_out = make_trainer(tmp_path, tiny_model_path)
    trainer.args.max_completion_length = 2  # the untrained tiny model rarely ends within 2 tokens: answers are cut
    sample_round, truncated = trainer.sample_round, []

    def recording(rows, backend):
        rollout, columns = sample_round(rows, backend)
        truncated.extend(rollout.is_truncated.tolist())
        return rollout, columns

    trainer.sample_round = recording
    samples = greedy_samples(trainer, held_out)
    assert [s["cut"] for s in samples] == truncated and any(truncated)
    assert greedy_metrics(samples)["eval_greedy_clipped_ratio"] == sum(truncated) / len(truncated)


def test_plot_panels_follow_what_moved():
    history = [
        {"step": 0, "eval_reward": 0.2},
        {"step": 0, "eval_greedy_accuracy": 0.3},
        *[
            {
                "step": s,
                "reward": 0.1 * s,
                "reward_std": 0.3,
                "rewards/a/mean": 0.1 * s,
                "entropy": 2.0 - 0.1 * s,
                "completions/mean_length": 10.0,  # constant: no panel
                "kl": 0.0,  # beta = 0
                "clip_ratio/region_mean": 0.0,  # on-policy
                "clip_ratio/low_mean": 0.0,
            }
            for s in range(1, 4)
        ],
        {"step": 3, "eval_reward": 0.8},
        {"step": 3, "eval_greedy_accuracy": 0.9},
        {"step": 3, "train_runtime": 12.0},
    ]
    training, evaluations = split_history(history)
    assert [h["step"] for h in training] == [1, 2, 3] and len(evaluations) == 4
    chosen = dict(panels(training, evaluations))
    assert list(chosen) == [
        "reward (band: ± reward_std, the spread within groups)",
        "entropy (nats per token)",
        "held-out prompts (sampled reward, greedy accuracy)",
    ]
    assert chosen["reward (band: ± reward_std, the spread within groups)"] == ["reward"]  # one function: no copy
    assert chosen["held-out prompts (sampled reward, greedy accuracy)"] == ["eval_reward", "eval_greedy_accuracy"]

    # A run with a KL term, a moving clip ratio and two reward functions gets those panels back.
    for i, h in enumerate(training):
        h.update({"kl": 0.01 * i, "clip_ratio/low_mean": 0.1 * i, "rewards/b/mean": 0.5, "completions/mean_length": i})
    chosen = dict(panels(training, []))
    assert chosen["KL to the reference"] == ["kl"] and chosen["clip ratio"] == ["clip_ratio/low_mean"]
    assert chosen["reward (band: ± reward_std, the spread within groups)"] == [
        "reward",
        "rewards/a/mean",
        "rewards/b/mean",
    ]
    assert "completion length (tokens)" in chosen and not any(t.startswith("held-out") for t in chosen)

    # The cut share has a panel when it moves, and when it stays put above 0 (at 1, no answer fits); never at 0.
    cut = "cut at max_completion_length (share of completions)"
    assert cut not in chosen  # not logged
    for share in (0.0, 1.0):
        for h in training:
            h["completions/clipped_ratio"] = share
        assert (cut in dict(panels(training, []))) == (share > 0)
    training[0]["completions/clipped_ratio"] = 0.5
    assert dict(panels(training, []))[cut] == ["completions/clipped_ratio"]
    assert list(dict(panels(training, []))).index(cut) == 2  # beside the completion length


def test_deepspeed_cpu_notice_filtered_only_without_an_accelerator(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    deepspeed_logger = logging.getLogger("DeepSpeed")
    monkeypatch.setattr(deepspeed_logger, "filters", [])
    notice = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."

    def shown(message):
        return bool(deepspeed_logger.filter(logging.LogRecord("DeepSpeed", logging.WARNING, "", 0, message, (), None)))

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    _quiet_deepspeed_on_cpu()
    assert shown(notice)  # a GPU (or other accelerator) torch sees: DeepSpeed's word on it stays
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    _quiet_deepspeed_on_cpu()
    _quiet_deepspeed_on_cpu()
    assert not shown(notice) and len(deepspeed_logger.filters) == 1  # that one message, one filter
    assert shown("Setting ds_accelerator to cpu (auto detect)") and shown("ZeRO stage 3 needs ...")
    assert "DS_ACCELERATOR" not in os.environ  # the process's environment is left as it was
