"""Asynchronous generation (grpo/generation/async_engine.py, grpo/training/async_rounds.py): the producer's version gate,
max_staleness=0 against the synchronous updates, and at staleness 1 each round's weights version and the behaviour
policy its loss is corrected with."""

import threading
import time

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import InputError
from grpo.data.sampler import round_indices
from grpo.generation import Completions
from grpo.generation.async_engine import ProducerError, RoundProducer, SharedEngine
from grpo.testing import tiny_model, tiny_tokenizer
from grpo.training.async_rounds import AsyncRounds
from tests.helpers.compare import assert_close_to_scale, assert_same_update, updates
from tests.helpers.scripted import TINY, ScriptedGeneration, capture_batches, reward_len, use_sampler


class _OneProcess:
    num_processes = 1


class _Engine:
    """A sampler that records the weights version of every load."""

    def __init__(self):
        self.loads = []

    def sync_weights(self, model, version):
        self.loads.append(version)

    def generate(self, model, prompt_ids):
        return Completions([[1] for _ in prompt_ids])


def _producer(engine, max_staleness, fail_at=None):
    """A producer whose round r first trains at step r, recording (round, version) as it makes them."""
    made = []

    def produce(r):
        if r == fail_at:
            raise ValueError(f"reward function broke on round {r}")
        _, version = engine.generate_local(None, [[0]])
        made.append((r, version))
        return r

    return RoundProducer(engine, produce, first_step=lambda r: r, max_staleness=max_staleness, first_round=0), made


def _wait_for(condition, seconds=10.0):
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return condition()


def test_producer_makes_a_round_only_with_weights_new_enough():
    engine = SharedEngine(_Engine(), _OneProcess())
    producer, made = _producer(engine, max_staleness=1)
    try:
        time.sleep(0.2)
        assert made == []  # no weights loaded yet: nothing to sample with
        engine.sync_weights(None, version=0)
        assert _wait_for(lambda: len(made) == 2)
        time.sleep(0.2)
        # Rounds 0 and 1 (first trained at steps 0 and 1) may use version 0; round 2 needs version >= 1.
        assert made == [(0, 0), (1, 0)]
        assert producer.take(0)[0] == 0 and producer.take(1)[0] == 1
        engine.sync_weights(None, version=1)
        assert producer.take(2)[0] == 2
        assert made[2] == (2, 1)
        with pytest.raises(RuntimeError, match="already taken"):
            producer.take(1)
    finally:
        producer.close()
    assert not producer.thread.is_alive()
    assert engine.backend.loads == [0, 1]


def test_staleness_zero_never_runs_ahead():
    engine = SharedEngine(_Engine(), _OneProcess())
    producer, made = _producer(engine, max_staleness=0)
    try:
        for step in range(3):
            engine.sync_weights(None, version=step)
            assert producer.take(step)[0] == step
            time.sleep(0.05)
            assert made[-1] == (step, step)  # the weights of its own step, nothing made beyond
    finally:
        producer.close()


def test_a_producer_failure_is_raised_in_the_trainer_thread():
    engine = SharedEngine(_Engine(), _OneProcess())
    producer, _ = _producer(engine, max_staleness=1, fail_at=1)
    try:
        engine.sync_weights(None, version=0)
        assert producer.take(0)[0] == 0
        with pytest.raises(ProducerError, match="round 1") as error:
            producer.take(1)
        assert isinstance(error.value.__cause__, ValueError)
    finally:
        producer.close()


def test_a_load_waits_for_the_generation_in_flight():
    started, release = threading.Event(), threading.Event()

    class Slow(_Engine):
        def generate(self, model, prompt_ids):
            started.set()
            release.wait(10)
            return super().generate(model, prompt_ids)

    engine = SharedEngine(Slow(), _OneProcess())
    generating = threading.Thread(target=engine.generate_local, args=(None, [[0]]))
    generating.start()
    assert started.wait(10)
    loading = threading.Thread(target=engine.sync_weights, args=(None, 5))
    loading.start()
    time.sleep(0.1)
    assert engine.backend.loads == []  # the engine is generating: the load waits
    release.set()
    loading.join(10)
    generating.join(10)
    assert engine.backend.loads == [5] and engine.version == 5


def test_a_background_load_lets_the_trainer_go_on():
    """With background_loads the trainer copies the weights and returns; the engine loads the copy in a thread,
    and what generates next (producer or evaluation) sees the new weights."""
    release = threading.Event()

    class SlowLoad(_Engine):
        def sync_weights(self, model, version):
            if version > 0:
                assert release.wait(10)
            self.loads.append((version, model.weight.item()))

    model = torch.nn.Linear(1, 1, bias=False)
    engine = SharedEngine(SlowLoad(), _OneProcess(), background_loads=True)
    with torch.no_grad():
        model.weight.fill_(1.0)
    engine.sync_weights(model, version=0)  # the first load runs in the caller's thread
    assert engine.version == 0 and engine.backend.loads == [(0, 1.0)]
    with torch.no_grad():
        model.weight.fill_(2.0)
    engine.sync_weights(model, version=1)  # returns before the load is done
    with torch.no_grad():
        model.weight.fill_(3.0)  # the next step changes the live weights: the load takes the copy
    assert engine.version == 0
    release.set()
    engine.generate(None, [[0]])  # waits for the load in flight
    assert engine.version == 1 and engine.backend.loads[-1] == (1, 2.0)


def test_a_failed_background_load_reaches_the_trainer():
    class BrokenLoad(_Engine):
        def sync_weights(self, model, version):
            if version > 0:
                raise ConnectionError("server went away")

    engine = SharedEngine(BrokenLoad(), _OneProcess(), background_loads=True)
    producer, _ = _producer(engine, max_staleness=0)
    try:
        model = torch.nn.Linear(1, 1)
        engine.sync_weights(model, version=0)
        assert producer.take(0)[0] == 0
        engine.sync_weights(model, version=1)
        with pytest.raises(RuntimeError, match="server went away"):
            producer.take(1)  # waits for version 1, which will never come
    finally:
        producer.close()


def test_round_indices_follow_the_loader_across_epochs():
    """The producer's rows of each round are the loader's, epoch after epoch (the trainer also checks the prompts
    of every round it takes, so a mismatch would stop training)."""
    args = GRPOConfig(output_dir="unused", **{**TINY, "num_generations": 2, "per_device_train_batch_size": 4})
    from grpo.data.sampler import train_sampler

    sampler = train_sampler(args, num_samples=6)  # 6 prompts, 2 per round: 3 rounds an epoch
    seen = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen.extend(list(sampler))
    rounds = [seen[i : i + 4] for i in range(0, len(seen), 4)]
    assert len(rounds) == 6
    for r, rows in enumerate(rounds):
        assert round_indices(args, 6, r, process_index=0, num_processes=1) == rows
        assert round_indices(args, 6, r, 0, 2) + round_indices(args, 6, r, 1, 2) == rows


def _trainer(output_dir, dataset=None, **config):
    tokenizer = tiny_tokenizer()
    if dataset is None:
        dataset = Dataset.from_dict({"prompt": [f"Question {i}: count to three." for i in range(16)]})
    settings = dict(optim="sgd", learning_rate=0.5, max_grad_norm=0.0, shuffle_dataset=True)
    args = GRPOConfig(output_dir=str(output_dir), **{**TINY, **settings, **config})
    return GRPOTrainer(tiny_model(tokenizer), reward_len, args=args, train_dataset=dataset, processing_class=tokenizer)


@pytest.mark.parametrize("layout", [dict(), dict(steps_per_generation=2), dict(gradient_accumulation_steps=2)])
def test_staleness_zero_gives_the_synchronous_updates(tmp_path, layout):
    """Three optimizer steps on scripted completions: async with max_staleness=0 takes the same rows, rewards and
    weights at every step as the synchronous trainer, so the parameters match."""
    params = {}
    for name, extra in (("sync", {}), ("async", dict(async_generation=True, max_staleness=0))):
        trainer = _trainer(tmp_path / name, max_steps=3, beta=0.04, **layout, **extra)
        use_sampler(trainer, ScriptedGeneration(4, 8))
        trainer.train()
        params[name] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        if name == "async":
            assert trainer.rounds.async_rounds.producer is None  # closed at the end of training
            staleness = [h["async/staleness_max"] for h in trainer.state.log_history if "async/staleness_max" in h]
            assert staleness and max(staleness) == 0
    initial = dict(tiny_model(tiny_tokenizer()).named_parameters())  # _trainer's model before training
    update, reference = updates(params["async"], initial), updates(params["sync"], initial)
    assert_same_update(update, reference, params["sync"], steps=3, what=f"async {layout}")


class _Snapshots(TrainerCallback):
    """The policy's weights after every optimizer step, by step (0: before training)."""

    def __init__(self, model):
        self.weights = {0: {k: v.clone() for k, v in model.state_dict().items()}}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = {k: v.clone() for k, v in model.state_dict().items()}


def test_staleness_one_trains_each_round_against_the_weights_that_sampled_it(tmp_path):
    """model.generate on a copy of the policy, 4 steps at max_staleness=1: round r (r >= 1) is sampled by the
    weights of step r - 1 while step r - 1 trains; its loss takes pi_old = the weights of step r and the behaviour
    policy = those of step r - 1 (the sampler's log-probs)."""
    trainer = _trainer(
        tmp_path,
        max_steps=4,
        async_generation=True,
        max_staleness=1,
        learning_rate=2.0,
        allow_large_learning_rate=True,
    )
    snapshots = _Snapshots(trainer.model)
    trainer.add_callback(snapshots)
    batches = capture_batches(trainer)
    versions = []
    take = trainer.rounds.async_rounds.take

    def recording_take(inputs, context):
        rollout, columns, scores = take(inputs, context)
        versions.append(rollout.weights_version)
        return rollout, columns, scores

    trainer.rounds.async_rounds.take = recording_take
    trainer.train()
    assert versions == [0, 0, 1, 2]
    assert len(batches) == 4  # one micro-batch per round

    def logprobs_at(step, batch):
        model = tiny_model(tiny_tokenizer())
        model.load_state_dict(snapshots.weights[step])
        return trainer.logprobs(model.eval(), batch)[0]

    moved = 0.0
    for r, batch in enumerate(batches):
        behaviour, current = logprobs_at(versions[r], batch), logprobs_at(r, batch)
        mask = batch.completion_mask.bool()
        assert_close_to_scale(batch.sampling_logps[mask], behaviour[mask], f"round {r}")
        # Each round trains in one step, so pi_old comes from its training pass (no pass of its own) and the
        # importance weight pi_old / behaviour the loss logged is the current weights' over the sampler's.
        assert batch.old_logps is None
        logged = trainer.state.log_history[r]["sampling/importance_sampling_ratio/max"]
        assert logged == pytest.approx((current - behaviour)[mask].exp().max().item(), rel=1e-4)
        moved = max(moved, (current - behaviour)[mask].abs().max().item())
    assert moved > 1e-3  # the weights really moved between sampling and training: the checks above can fail
    ratios = [h["sampling/importance_sampling_ratio/max"] for h in trainer.state.log_history if "sampling/" in str(h)]
    assert ratios and max(ratios) != 1.0


def test_a_round_older_than_max_staleness_is_dropped_and_made_again(tmp_path, monkeypatch):
    """When steps outrun the producer's forecast of when a round trains, a round sampled by weights more than
    max_staleness steps old is dropped, counted and made again with the current weights."""
    monkeypatch.setattr(AsyncRounds, "first_step", lambda self, r: 0)  # a forecast that every round trains at once
    trainer = _trainer(tmp_path, max_steps=4, async_generation=True, max_staleness=1)

    class HoldStepOne(TrainerCallback):
        """After step 0, wait until rounds 1-3 are made (all with the weights of step 0)."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                assert _wait_for(lambda: trainer.rounds.async_rounds.producer.next_round >= 4)

    trainer.add_callback(HoldStepOne())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "async/dropped_rows" in h]
    assert sum(h["async/dropped_rows"] for h in logs) > 0
    assert max(h["async/staleness_max"] for h in logs) <= 1


def test_a_stale_round_without_sampler_logprobs_stops_training(tmp_path):
    trainer = _trainer(tmp_path, max_steps=3, async_generation=True, max_staleness=1)
    use_sampler(trainer, ScriptedGeneration(4, 8))  # reports no log-probs
    with pytest.raises(RuntimeError, match="reported no log-probs"):
        trainer.train()
    assert trainer.rounds.async_rounds.producer is None  # the producer was stopped on the way out


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(dynamic_sampling=True), "dynamic_sampling"),
        (dict(max_staleness=1, vllm_importance_sampling_correction=False), "importance-sampling"),
        (dict(max_staleness=-1), "max_staleness"),
    ],
)
def test_bad_async_settings_fail_at_construction(config, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(output_dir="unused", async_generation=True, **config)


def test_async_generation_refuses_stored_completions(tmp_path):
    data = Dataset.from_dict({"prompt": ["a", "a"], "completion": ["x", "y"], "reward": [1.0, 0.0]})
    with pytest.raises(InputError, match="async_generation=True, but train_dataset holds stored"):
        _trainer(tmp_path, dataset=data, async_generation=True, num_generations=2, per_device_train_batch_size=2)
