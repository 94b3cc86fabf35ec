"""Streamed data sets (`IterableDataset`, no length; grpo/data/stream.py): the rounds a map-style set would give, read
in order; a resume that reads what the uninterrupted run read; disjoint rows on 2 processes; a finite evaluation
stream evaluated whole; and the settings a stream cannot take refused when the trainer is built."""

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset, IterableDataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import InputError
from grpo.data.sampler import round_indices
from grpo.data.stream import RoundBatches, RoundRows, round_batches, train_stream
from grpo.testing import tiny_model, tiny_tokenizer
from tests.helpers.net import launch_two_processes
from tests.helpers.scripted import TINY, reward_len

ROOT = Path(__file__).resolve().parent.parent


def numbered(count: int, start: int = 0):
    for i in range(start, start + count):
        yield {"prompt": f"Prompt {i}"}


class TorchStream(torch.utils.data.IterableDataset):
    """A torch stream (no shuffle buffer, no state_dict) of `count` prompts, counting the rows it gives."""

    def __init__(self, count: int):
        self.count, self.given = count, 0

    def __iter__(self):
        for row in numbered(self.count):
            self.given += 1
            yield row


def make_stream(kind: str, count: int):
    if kind == "torch":
        return TorchStream(count)
    return IterableDataset.from_generator(numbered, gen_kwargs={"count": count})


def stream_args(tmp_path, **settings) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path / "out"), **{**TINY, "max_steps": 4, **settings})


def prompts(rows) -> list[str]:
    return [row["prompt"] for row in rows]


# ---- Reading rounds (no model) ----


def test_each_process_gets_the_rows_of_a_round_a_map_style_set_gives(tmp_path):
    # Rounds of 3 prompts x G = 4 = 12 rows, 6 a process: prompt 1's group spans the two processes, as it does with a
    # map-style set; each round feeds steps_per_generation x num_iterations = 4 micro-steps.
    args = stream_args(tmp_path, per_device_train_batch_size=3, steps_per_generation=4, shuffle_dataset=False)
    args.num_iterations = 2  # set after construction: the config's checks need not know the two "processes"
    data = Dataset.from_generator(numbered, gen_kwargs={"count": 9})
    for process in (0, 1):
        rows = RoundRows(train_stream(args, make_stream("datasets", 9)))
        batches = iter(round_batches(args, process, 2))
        for micro_step in range(3 * args.micro_steps_per_round):
            expected = round_indices(args, 9, micro_step // args.micro_steps_per_round, process, 2)
            assert prompts(rows[i] for i in next(batches)) == prompts(data[i] for i in expected), micro_step


def test_batches_of_a_round_read_it_once():
    # Skipping the batches before a resume point reads nothing; every micro-step of a round reads the same rows.
    batches = iter(RoundBatches(prompts_per_round=2, num_generations=3, repeat_count=2, rows=slice(3, 6)))
    assert [next(batches) for _ in range(5)] == [[1, 1, 1], [1, 1, 1], [3, 3, 3], [3, 3, 3], [5, 5, 5]]


@pytest.mark.parametrize("kind,shuffle", [("datasets", False), ("datasets", True), ("torch", False)])
def test_a_resumed_stream_reads_what_the_uninterrupted_one_read(tmp_path, kind, shuffle):
    # 7 prompts in rounds of 2: 3 rounds a pass, the 7th prompt dropped, then a new pass.
    args = stream_args(tmp_path, per_device_train_batch_size=4, num_generations=2, shuffle_dataset=shuffle)
    uninterrupted = train_stream(args, make_stream(kind, 7))
    expected = [prompts(uninterrupted.round(r)) for r in range(6)]
    first_pass, second_pass = sum(expected[:3], []), sum(expected[3:], [])
    assert len(set(first_pass)) == len(set(second_pass)) == 6  # each pass draws distinct prompts
    if shuffle:  # a new pass, a new order (datasets reshuffles with seed + pass)
        assert first_pass != second_pass and sorted(first_pass) != [f"Prompt {i}" for i in range(6)]
    else:
        assert first_pass == second_pass == [f"Prompt {i}" for i in range(6)]

    for stop in (1, 4):  # the round in progress when the run stopped: in the first pass, in the second
        stopped = train_stream(args, make_stream(kind, 7))
        for r in range(stop + 1):
            stopped.round(r)
        state = json.loads(json.dumps(stopped.state_dict()))  # what a checkpoint holds: plain values
        assert state["round"] == stop and (state["state"] is not None) == (kind == "datasets" and not shuffle)
        source = make_stream(kind, 7)
        resumed = train_stream(args, source)
        resumed.load_state_dict(state)
        assert [prompts(resumed.round(r)) for r in range(stop, 6)] == expected[stop:], stop
        if kind == "torch":  # read again from the start of the pass (2 rows before the round), then on to round 6
            assert source.given == (7 + 6 if stop == 1 else 6)


def test_asking_for_an_earlier_round_reads_the_stream_from_its_start(tmp_path):
    # A second train() call starts at micro-step 0 again, as a map-style set's order does.
    args = stream_args(tmp_path, per_device_train_batch_size=4, num_generations=2, shuffle_dataset=False)
    rounds = train_stream(args, make_stream("datasets", 7))
    assert prompts(rounds.round(2)) == ["Prompt 4", "Prompt 5"]
    assert prompts(rounds.round(0)) == ["Prompt 0", "Prompt 1"]


def test_a_stream_shorter_than_a_round_is_refused_when_read(tmp_path):
    args = stream_args(tmp_path, per_device_train_batch_size=4, num_generations=2)
    with pytest.raises(InputError, match=r"train_dataset is a stream of 1 prompts, fewer than one generation round"):
        train_stream(args, make_stream("datasets", 1)).round(0)


def test_a_bad_streamed_row_is_named_when_read(tmp_path):
    args = stream_args(tmp_path, per_device_train_batch_size=4, num_generations=2, shuffle_dataset=False)
    rows = [{"prompt": "fine"}, {"prompt": "also fine"}, {"prompt": ""}, {"prompt": "x"}]
    stream = IterableDataset.from_generator(lambda: iter(rows))
    rounds = train_stream(args, stream)
    rounds.round(0)
    with pytest.raises(InputError, match=r"train_dataset row 2 \(pass 1\): the prompt is an empty string"):
        rounds.round(1)


# ---- Settings a stream cannot take, refused when the trainer is built ----


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(max_steps=-1), r"num_train_epochs=3.0 cannot say how long to train: set max_steps"),
        (dict(dataloader_num_workers=2), r"dataloader_num_workers=2: a stream is read in order"),
        (dict(dynamic_sampling=True, loss_type="dapo"), r"dynamic_sampling=True draws extra prompts by index"),
        (dict(async_generation=True), r"async_generation=True reads rounds ahead by index"),
    ],
)
def test_settings_a_stream_cannot_take_are_refused_before_the_model_loads(tmp_path, monkeypatch, settings, message):
    import grpo.models

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the settings were refused")

    monkeypatch.setattr(grpo.models, "load_causal_lm", no_load)
    args = stream_args(tmp_path, **settings)
    with pytest.raises(InputError, match=message):
        GRPOTrainer("never-loaded", reward_len, args=args, train_dataset=make_stream("datasets", 8))


def test_a_torch_stream_is_taken_in_its_order_with_a_warning(tmp_path):
    tokenizer = tiny_tokenizer()
    with pytest.warns(UserWarning, match=r"TorchStream, which has no shuffle buffer: its rows are taken in its own"):
        GRPOTrainer(
            tiny_model(tokenizer),
            reward_len,
            args=stream_args(tmp_path),
            train_dataset=TorchStream(8),
            processing_class=tokenizer,
        )


def test_a_streamed_column_named_like_a_reward_argument_is_refused(tmp_path):
    # A stream that lists its columns (a datasets stream with features) is checked like a map-style set.
    stream = Dataset.from_dict({"prompt": ["q", "r"], "completions": ["a", "b"]}).to_iterable_dataset()
    with pytest.raises(InputError, match=r"eval_dataset has column\(s\) \['completions'\]"):
        GRPOTrainer(
            "never-loaded",
            reward_len,
            args=stream_args(tmp_path),
            train_dataset=make_stream("datasets", 8),
            eval_dataset=stream,
        )


# ---- Evaluation ----


def test_a_streamed_evaluation_set_is_evaluated_whole_like_a_map_style_one(tmp_path):
    # 7 prompts, one completion each, batches of 2: 2, 2, 2 and a last one of 1, read from the stream.
    from tests.helpers.eval_two_processes import evaluate

    streamed, seen = evaluate(str(tmp_path / "stream"), "dapo", stream=True)
    whole, seen_whole = evaluate(str(tmp_path / "whole"), "dapo")
    assert seen == seen_whole == [f"Held out {i}" for i in range(7)]
    assert streamed == pytest.approx(whole, rel=1e-6, nan_ok=True) and streamed["eval_loss"] > 0


# ---- Training ----

SCRIPT = ROOT / "tests" / "helpers" / "resume_run.py"

# Rounds of 2 prompts x G = 4 rows. Each run is killed after micro-step 4, so it resumes from checkpoint-3, inside the
# second round, which does not start its pass; the resumed run finishes it from the checkpoint's buffer and then draws
# the round the uninterrupted one drew after it.
STREAM_SCENARIOS = {
    # Shuffled by the stream's buffer; 7 prompts, 3 rounds a pass; a round feeds 2 micro-steps (steps_per_generation).
    # The resume reads the pass again up to round 2 (a shuffle buffer is not in the stream's state), then round 3.
    "shuffled": dict(
        settings=dict(per_device_train_batch_size=4, steps_per_generation=2, max_steps=6),
        kill="4",
        prompts="7",
    ),
    # In the stream's order; each round trained twice (num_iterations = 2). The resume continues from the stream's
    # own state_dict at round 2, and reads round 3 on from there.
    "in_order": dict(
        settings=dict(per_device_train_batch_size=8, num_iterations=2, max_steps=6, shuffle_dataset=False),
        kill="4",
        prompts="7",
    ),
}


def run_script(settings, output_dir, prompts, *extra, killed=False):
    import subprocess
    import sys

    process = subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(settings), str(output_dir), "--stream", "--prompts", prompts, *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == (-9 if killed else 0), process.stderr[-3000:]
    return None if killed else torch.load(Path(output_dir) / "result.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STREAM_SCENARIOS))
def test_a_generator_stream_trains_and_resumes_exactly_after_a_kill(tmp_path, name):
    from tests.test_resume import comparable, step_logs

    scenario = STREAM_SCENARIOS[name]
    settings, count = scenario["settings"], scenario["prompts"]
    full = run_script(settings, tmp_path / "full", count)
    # Each round's 2 prompts, G rows each, drawn once: the rewards saw them at the round's first micro-step only.
    drawn = full["prompts"]
    assert len(drawn) == 3 * 8
    rounds = [sorted(set(drawn[r * 8 : (r + 1) * 8])) for r in range(3)]
    assert all(len(group) == 2 and all(drawn.count(p) % 4 == 0 for p in group) for group in rounds)
    assert len(set(rounds[0] + rounds[1])) == 4  # the first two rounds: four distinct prompts
    initial = dict(tiny_model(tiny_tokenizer()).named_parameters())
    assert all(not torch.equal(value, initial[param]) for param, value in full["params"].items())  # it trained

    out = tmp_path / "killed"
    run_script(settings, out, count, "--kill-after-micro-step", scenario["kill"], killed=True)
    resume_step = int(max(out.glob("checkpoint-*")).name.rsplit("-", 1)[1])
    resumed = run_script(settings, out, count, "--resume")
    expected, got = step_logs(full["log_history"]), step_logs(resumed["log_history"])
    after = [step for step in expected if step > resume_step]
    assert after
    for step in after:
        assert comparable(got[step]) == comparable(expected[step]), step
    for param, value in full["params"].items():
        assert torch.equal(resumed["params"][param], value), param
    # The resumed run drew the rounds after the one in progress, as the uninterrupted run did.
    assert resumed["prompts"] == drawn[len(drawn) - len(resumed["prompts"]) :] and resumed["prompts"]


@pytest.mark.distributed
def test_two_processes_read_disjoint_rows_of_the_same_rounds_and_evaluate_a_stream_whole(tmp_path):
    """2 processes: each round's rows split between them (no row twice, each prompt's G rows kept together), the
    rounds those of one process reading the stream alone; a stream that differs between processes refused; a
    streamed evaluation set gives 1 process's metrics."""
    from tests.helpers.eval_two_processes import evaluate
    from tests.helpers.stream_two_processes import SETTINGS, questions

    out_file = tmp_path / "two.pt"
    launch_two_processes(ROOT / "tests" / "helpers" / "stream_two_processes.py", out_file)
    result = torch.load(out_file)
    first, second = result["train"]
    assert len(first) == len(second) == 3
    # The rounds one process reading the stream alone would train on (shuffled by the stream's buffer, seed 3).
    args = GRPOConfig(output_dir=str(tmp_path / "alone"), **{**TINY, **SETTINGS, "per_device_train_batch_size": 8})
    alone = train_stream(args, IterableDataset.from_generator(questions))
    for r, (mine, theirs) in enumerate(zip(first, second)):
        assert not set(mine) & set(theirs), r  # disjoint prompts, so disjoint rows
        assert all(mine.count(p) == 2 for p in mine) and all(theirs.count(p) == 2 for p in theirs)  # whole groups
        assert sorted(set(mine) | set(theirs)) == sorted(prompts(alone.round(r))), r

    # A stream that gives each process other rows is refused at its first round, on both processes.
    assert len(result["mismatched"]) == 2
    for message in result["mismatched"]:
        assert "The processes read different rows from train_dataset, a stream" in message

    two, seen = result["eval"]
    one, seen_alone = evaluate(str(tmp_path / "one"), "dapo")
    assert sorted(seen) == seen_alone == [f"Held out {i}" for i in range(7)]  # each prompt once
    for key, value in one.items():
        if key.endswith("/std"):  # a function's spread within each batch: it depends on how rows are batched
            continue
        assert two[key] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), key
