"""Environments hold real resources (grpo/generation/environment_pool.py): objects are pooled and reused through
`reset`, made lazily up to what a round needs, given live to the reward functions, and closed however training ends
(normally, with an error, on SIGTERM) and when an unused trainer is garbage-collected. The lifecycle tests count the
open files, threads and child processes of this process before and after: nothing may be left."""

import gc
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import InputError
from grpo.generation.environment_checks import EnvironmentFactoryError
from grpo.generation.environment_pool import EnvironmentPool, group_seed
from grpo.generation.tools import ToolDefinitionError
from grpo.rewards.runner import RewardFunctionError
from grpo.testing import save_tiny_model
from tests.helpers.agents import ScriptedTurns, call, tool_tokenizer

G = 2
HOLDER_THREAD = "test-environment-holder"


class HoldingEnv:
    """An environment that holds each kind of resource: an open file, a thread, a child process. `close()` releases
    them; `made` and `closed` count the objects (class-wide, reset by each test)."""

    made: list["HoldingEnv"] = []
    closed: list["HoldingEnv"] = []
    folder: Path | None = None

    def __init__(self):
        HoldingEnv.made.append(self)
        self.file = open(HoldingEnv.folder / f"env-{len(HoldingEnv.made)}.log", "w")  # noqa: SIM115 (held)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.stop.wait, name=HOLDER_THREAD, daemon=True)
        self.thread.start()
        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        self.resets: list[dict] = []
        self.counter = 0

    def reset(self, **kwargs) -> str:
        self.resets.append(kwargs)
        self.counter = 0
        return " Count."

    def increment(self, step: int) -> int:
        """Increment the counter.

        Args:
            step: what to add
        """
        self.counter += step
        self.file.write(f"{step}\n")
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter)

    def close(self) -> None:
        self.file.close()
        self.stop.set()
        self.thread.join()
        self.child.terminate()
        self.child.wait()
        HoldingEnv.closed.append(self)


def resources() -> dict[str, int]:
    """This process's open file descriptors, environment-holder threads and living child processes."""
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return {
        "open_files": len(os.listdir("/proc/self/fd")),
        "threads": sum(t.name == HOLDER_THREAD for t in threading.enumerate()),
        "children": len(children.read_text().split()),
    }


needs_proc = pytest.mark.skipif(
    not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(), reason="counts resources through /proc"
)


@pytest.fixture(autouse=True)
def fresh_counts(tmp_path):
    HoldingEnv.made, HoldingEnv.closed, HoldingEnv.folder = [], [], tmp_path
    yield
    for environment in HoldingEnv.made:  # a failing test must not leave children behind for the next one
        if environment not in HoldingEnv.closed:
            environment.close()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    save_tiny_model(path, max_position_embeddings=4096)  # episode prompts with the tools' schemas are long
    tool_tokenizer().save_pretrained(path)
    return str(path)


def rows(n: int) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"row={i}"}] for i in range(n)], "level": [*range(n)]}
    )


def make_trainer(tmp_path, model_path, reward=None, factory=HoldingEnv, data=None, eval_data=None, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_completion_length=400,
        max_prompt_length=None,  # the byte-level tokenizer makes the tool schemas long
        num_generations=G,
        per_device_train_batch_size=2 * G,  # two prompts of G episodes: a round runs 4 environments at once
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        max_tool_calling_iterations=1,
    )
    tokenizer = tool_tokenizer()
    trainer = GRPOTrainer(
        model_path,
        reward or [],
        args=GRPOConfig(**{**settings, **overrides}),
        train_dataset=rows(4) if data is None else data,
        eval_dataset=eval_data,
        processing_class=tokenizer,
        environment_factory=factory,
    )
    trainer.generation = ScriptedTurns(tokenizer, [[call("increment", step=2), "Done."]])
    return trainer


@needs_proc
def test_a_run_reuses_its_environments_and_leaves_nothing_open(tmp_path, model_path):
    before = resources()
    seen = []

    def live(environments, **kwargs):
        seen.append(environments)
        return [float(e.counter) for e in environments]

    trainer = make_trainer(tmp_path, model_path, reward=live)
    trainer.train()
    # Two rounds of 4 episodes: 4 objects made (the construction probe among them), each reset once per round.
    assert len(HoldingEnv.made) == 4
    assert sorted(len(e.resets) for e in HoldingEnv.made) == [2, 2, 2, 2]
    # The reward functions got the live objects the episodes ran in, not copies.
    assert all(e in HoldingEnv.made for round_ in seen for e in round_)
    assert trainer.state.log_history[0]["rewards/live/mean"] == pytest.approx(2.0)
    assert set(HoldingEnv.closed) == set(HoldingEnv.made)
    del trainer
    gc.collect()
    assert resources() == before


@needs_proc
def test_a_run_that_fails_mid_round_closes_its_environments(tmp_path, model_path):
    before = resources()

    def fails_in_round_two(completions, trainer_state, **kwargs):
        if trainer_state.global_step == 1:
            raise ValueError("the scorer is down")
        return [0.0] * len(completions)

    trainer = make_trainer(tmp_path, model_path, reward=fails_in_round_two)
    with pytest.raises(RewardFunctionError, match="fails_in_round_two"):
        trainer.train()
    assert HoldingEnv.made and set(HoldingEnv.closed) == set(HoldingEnv.made)
    del trainer
    gc.collect()
    assert resources() == before


@needs_proc
def test_a_run_stopped_by_sigterm_closes_its_environments(tmp_path, model_path):
    """The first SIGTERM stops training after the step in progress, with a checkpoint (preemption.py): the
    environments are closed before `train()` raises `Preempted`."""
    before = resources()

    class SignalledEnv(HoldingEnv):
        def increment(self, step: int) -> int:
            """Increment the counter; the job scheduler sends SIGTERM meanwhile.

            Args:
                step: what to add
            """
            if len(HoldingEnv.made) and self is HoldingEnv.made[0]:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().increment(step)

    trainer = make_trainer(tmp_path, model_path, factory=SignalledEnv, reward=lambda_free_reward, max_steps=5)
    with pytest.raises(SystemExit, match="Stopped on SIGTERM after step 1"):
        trainer.train()
    assert set(HoldingEnv.closed) == set(HoldingEnv.made)
    del trainer
    gc.collect()
    assert resources() == before


def lambda_free_reward(completions, **kwargs):
    return [0.0] * len(completions)


@needs_proc
def test_a_trainer_dropped_without_training_closes_its_probe(tmp_path, model_path):
    before = resources()
    trainer = make_trainer(tmp_path, model_path)
    assert len(HoldingEnv.made) == 1 and not HoldingEnv.closed  # built to check the class, kept for episode one
    del trainer
    gc.collect()
    assert HoldingEnv.closed == HoldingEnv.made
    assert resources() == before


def test_evaluation_after_training_makes_new_environments_and_closes_them_when_collected(tmp_path, model_path):
    trainer = make_trainer(tmp_path, model_path, reward=lambda_free_reward, max_steps=1, eval_strategy="no")
    trainer.train()
    closed_at_the_end = len(HoldingEnv.closed)
    assert closed_at_the_end == len(HoldingEnv.made)
    trainer.evaluate(rows(4))
    assert len(HoldingEnv.made) > closed_at_the_end  # new objects for the evaluation's episodes
    del trainer
    gc.collect()
    assert set(HoldingEnv.closed) == set(HoldingEnv.made)


def test_a_failing_close_is_a_warning_and_the_others_still_close():
    class BadClose:
        def close(self):
            raise OSError("the container is gone")

    closed = []

    class GoodClose:
        def close(self):
            closed.append(self)

    good = GoodClose()
    pool = EnvironmentPool(BadClose, BadClose())
    pool.made.append(good)
    with pytest.warns(RuntimeWarning, match=r"BadClose.close\(\) raised OSError: the container is gone"):
        pool.close()
    assert closed == [good] and pool.made == [] and pool.idle == []


def test_an_async_close_is_awaited():
    closed = []

    class AsyncClose:
        async def close(self):
            closed.append(self)

    pool = EnvironmentPool(AsyncClose)
    environment = pool.take()
    pool.close()
    assert closed == [environment]


def test_the_pool_grows_only_to_what_is_taken_at_once():
    pool = EnvironmentPool(object)
    first = [pool.take(), pool.take()]
    pool.give_back(first)
    second = [pool.take(), pool.take()]
    assert pool.created == 2 and {id(e) for e in second} == {id(e) for e in first}
    pool.give_back([object()])  # not the pool's: ignored
    pool.give_back(second + second)  # given back twice: idle once
    assert len(pool.idle) == 2


def test_a_group_starts_from_one_seed(tmp_path, model_path):
    class SeededEnv(HoldingEnv):
        def reset(self, seed: int, **kwargs) -> str:
            return super().reset(seed=seed, **kwargs)

    trainer = make_trainer(
        tmp_path, model_path, factory=SeededEnv, reward=lambda_free_reward, max_steps=1, environment_group_seed=True
    )
    trainer.train()
    resets = [r for e in HoldingEnv.made for r in e.resets]
    by_level: dict[int, set[int]] = {}
    for reset in resets:
        by_level.setdefault(reset["level"], set()).add(reset["seed"])
    assert len(by_level) == 2 and all(len(seeds) == 1 for seeds in by_level.values())  # one seed per group
    seeds = [next(iter(s)) for s in by_level.values()]
    assert seeds[0] != seeds[1]  # and groups differ
    level = resets[0]["level"]
    row = {"prompt": [{"role": "user", "content": f"row={level}"}], "level": level}
    assert by_level[level] == {group_seed(row, trainer.args.seed)}


def test_group_seed_misuse_is_refused_at_construction(tmp_path, model_path):
    class NoSeed(HoldingEnv):
        def reset(self, level: int, prompt) -> str:
            return " Count."

    with pytest.raises(ToolDefinitionError, match=r"NoSeed.reset takes no `seed` argument"):
        make_trainer(tmp_path, model_path, factory=NoSeed, environment_group_seed=True)
    with pytest.raises(ToolDefinitionError, match="no environment_factory was given"):
        GRPOTrainer(
            model_path,
            lambda_free_reward,
            args=GRPOConfig(
                output_dir=str(tmp_path / "o"), use_cpu=True, report_to="none", environment_group_seed=True
            ),
            train_dataset=rows(2),
        )


class PlainEnv:
    """An environment a deep copy would copy without complaint (nothing but numbers)."""

    made: list["PlainEnv"] = []

    def __init__(self):
        PlainEnv.made.append(self)
        self.counter = 0

    def reset(self, **kwargs) -> None:
        self.counter = 0

    def increment(self, step: int) -> int:
        """Increment the counter.

        Args:
            step: what to add
        """
        self.counter += step
        return self.counter


def test_reward_functions_get_the_live_environments(tmp_path, model_path):
    """As in TRL: a reward reads the object the episode ran in, not a copy of it."""
    seen = []

    def live(environments, **kwargs):
        seen.extend(environments)
        return [float(e.counter) for e in environments]

    PlainEnv.made = []
    trainer = make_trainer(tmp_path, model_path, reward=live, factory=PlainEnv, max_steps=1)
    trainer.train()
    assert len(seen) == 4 and all(any(e is made for made in PlainEnv.made) for e in seen)


# Faults of a factory and of what it makes (issue 50): each ends the run, or refuses the trainer, with a message naming
# `environment_factory` or the class's `reset`, and closes whatever was made.


@needs_proc
def test_a_factory_that_raises_on_its_third_object_is_named_and_what_it_made_is_closed(tmp_path, model_path):
    before = resources()

    def flaky_factory():
        if len(HoldingEnv.made) == 2:
            raise ConnectionError("port 8000 is busy")
        return HoldingEnv()

    trainer = make_trainer(tmp_path, model_path, factory=flaky_factory, reward=lambda_free_reward)
    with pytest.raises(
        EnvironmentFactoryError,
        match=r"environment_factory \(.*flaky_factory\) raised ConnectionError "
        r"making its 3rd object: port 8000 is busy",
    ) as raised:
        trainer.train()
    assert isinstance(raised.value.__cause__, ConnectionError)
    assert len(HoldingEnv.made) == 2 and set(HoldingEnv.closed) == set(HoldingEnv.made)
    del trainer
    gc.collect()
    assert resources() == before


@pytest.mark.parametrize(
    ("returned", "shown"),
    [
        (3, r"returned 3 \(type int\)"),
        ([{"role": "user", "content": "Go."}], r"returned \[\{'role'.*\(type list\)"),
    ],
)
def test_reset_returning_neither_none_nor_a_string_names_reset(tmp_path, model_path, returned, shown):
    """TRL's contract: `reset` returns None or a string appended to the prompt; anything else was a TypeError from a
    string concatenation naming nothing."""

    class OddReset(HoldingEnv):
        def reset(self, **kwargs):
            super().reset(**kwargs)
            return returned

    trainer = make_trainer(tmp_path, model_path, factory=OddReset, reward=lambda_free_reward)
    with pytest.raises(EnvironmentFactoryError, match=rf"OddReset.reset {shown}.* must return None or a string") as e:
        trainer.train()
    assert ("`prompt` column" in str(e.value)) == isinstance(returned, list)  # messages: where a conversation goes
    assert trainer.state.global_step == 0 and set(HoldingEnv.closed) == set(HoldingEnv.made)


def test_an_environment_object_passed_as_the_factory_is_refused_naming_its_class(tmp_path, model_path):
    instance = PlainEnv()
    message = (
        "must be a class or a zero-argument callable returning a new environment; got an instance of PlainEnv: "
        "pass PlainEnv"
    )
    with pytest.raises(EnvironmentFactoryError, match=f"^environment_factory {message}"):
        make_trainer(tmp_path, model_path, factory=instance)
    data = rows(4).add_column("environment", ["a"] * 4)
    with pytest.raises(EnvironmentFactoryError, match=rf"^environment_factory\['b'\] {message}"):
        make_trainer(tmp_path, model_path, factory={"a": PlainEnv, "b": instance}, data=data)


def test_a_factory_returning_one_shared_object_is_refused_before_the_first_episode(tmp_path, model_path):
    shared = PlainEnv()
    trainer = make_trainer(tmp_path, model_path, factory=lambda: shared, reward=lambda_free_reward)
    with pytest.raises(
        EnvironmentFactoryError, match=r"returned an object already in use \(PlainEnv at .*share one state"
    ):
        trainer.train()
    assert trainer.state.global_step == 0 and not shared.counter  # no episode ran on it
    # Two factories of a dict returning one object: seen when the trainer is built.
    data = rows(4).add_column("environment", ["a", "b"] * 2)
    with pytest.raises(EnvironmentFactoryError, match=r"environment_factory\['b'\].*already in use"):
        make_trainer(tmp_path, model_path, factory={"a": lambda: shared, "b": lambda: shared}, data=data)


class OtherEnv(PlainEnv):
    pass


def test_environment_rows_are_checked_when_the_trainer_is_built(tmp_path, model_path):
    """With a dict of factories, a row naming no factory, or data without the `environment` column, is refused when
    the trainer is built (it was found only in the round that met it); a stream is not read ahead."""
    factories = {"counter": PlainEnv, "other": OtherEnv}
    good = rows(4).add_column("environment", ["counter", "other"] * 2)
    typo = rows(4).add_column("environment", ["counter", "other", "countr", "other"])
    with pytest.raises(InputError, match=r"^train_dataset row 2 has environment='countr'.*Did you mean 'counter'\?"):
        make_trainer(tmp_path, model_path, factory=factories, data=typo)
    with pytest.raises(InputError, match=r"eval_dataset\['held'\] row 2 has environment='countr'"):
        make_trainer(tmp_path, model_path, factory=factories, data=good, eval_data={"held": typo})
    with pytest.raises(InputError, match=r"but train_dataset has none\. Add that column"):
        make_trainer(tmp_path, model_path, factory=factories, data=rows(4))
    stream = typo.to_iterable_dataset()
    trainer = make_trainer(tmp_path, model_path, factory=factories, data=stream, reward=lambda_free_reward)
    with pytest.raises(ToolDefinitionError, match="environment='countr'.*Did you mean 'counter'"):
        trainer.train()  # the stream's third row, met in the first round
