"""`grpo train` says once when its compute threads would share the CPU with other work (grpo/cli/threads.py), with
the load and the cores injected: nothing here depends on this machine's real load."""

import os
from types import SimpleNamespace

import pytest
import torch
import yaml

from grpo.cli import main, threads
from grpo.cli.threads import ThreadWatch, check_threads, machine_load, oversubscription, usable_cores
from tests.helpers.scripted import TINY


def test_oversubscribed_when_other_work_and_our_threads_need_a_core_more_than_there_are():
    # 2 cores, load 4 of which 1 is this process: 3 other threads; with our 2, 5 want 2 cores.
    line = oversubscription(load=4.0, cores=2, threads=2, own=1.0)
    assert "about 3.0 of its 2 cores busy (load 4.0)" in line and "computes on 2 thread(s)" in line
    assert "OMP_NUM_THREADS=1" in line and "stop the other jobs" in line
    # 8 cores, 2.2 others: 6 would fit, 8 do not (2.2 + 8 >= 9).
    assert "OMP_NUM_THREADS=6" in oversubscription(load=3.2, cores=8, threads=8, own=1.0)
    # Already one thread: only the other jobs can give way.
    single = oversubscription(load=5.0, cores=2, threads=1, own=1.0)
    assert "OMP_NUM_THREADS" not in single and "this run already computes on one thread" in single
    assert "waits for a free core" in single and "each other" not in single  # one thread waits on nothing of its own
    # Not oversubscribed: the machine is this run's, or the others use less than one core beside ours.
    assert oversubscription(load=2.0, cores=2, threads=2, own=2.0) is None
    assert oversubscription(load=1.9, cores=2, threads=2, own=1.0) is None  # 0.9 others + 2 < 3
    # Unknown load or cores: nothing said.
    assert oversubscription(load=None, cores=2, threads=2, own=1.0) is None
    assert oversubscription(load=9.0, cores=None, threads=2, own=1.0) is None


def test_check_says_the_line_through_its_sink_and_changes_no_thread_count():
    said, before = [], torch.get_num_threads()
    assert check_threads(2, 1.0, said.append, load=lambda: 6.0, cores=lambda: 2) is True
    assert len(said) == 1 and said[0].startswith("grpo train: the CPU is oversubscribed")
    assert check_threads(2, 1.0, said.append, load=lambda: 0.5, cores=lambda: 2) is False and len(said) == 1
    assert torch.get_num_threads() == before  # advice only: the process-wide setting is the user's


def test_watch_during_training_says_it_once_and_not_again_after_the_start():
    state = SimpleNamespace(is_local_process_zero=True)
    load, said = [0.5], []
    watch = ThreadWatch(2, said.append, load=lambda: load[0], cores=lambda: 2)
    watch.on_log(None, state, None)
    assert said == []  # idle so far
    load[0] = 6.0  # another job started; our 2 threads are part of the load now: 4 others
    watch.on_log(None, state, None)
    watch.on_log(None, state, None)
    assert len(said) == 1 and "about 4.0 of its 2 cores" in said[0]
    quiet = ThreadWatch(2, said.append, said=True, load=lambda: 6.0, cores=lambda: 2)  # said at the start already
    quiet.on_log(None, state, None)
    assert len(said) == 1


def test_sources_degrade_where_the_system_lacks_them(monkeypatch):
    monkeypatch.delattr(os, "getloadavg", raising=False)  # Windows
    assert machine_load() is None
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows
    assert usable_cores() == os.cpu_count()


@pytest.mark.slow
def test_train_says_it_once_on_a_loaded_machine(tmp_path, tiny_model_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(threads, "machine_load", lambda: 50.0)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    recipe = {
        "model": str(tiny_model_path),
        "dataset": {"reasoning_gym": "basic_arithmetic", "size": 8},
        "rewards": ["reasoning_gym"],
        "output_dir": "out",
        "max_steps": 2,  # two logged steps: the watch during training stays quiet after the line at the start
        "run": {"plot": False, "save_model": False},
        **TINY,
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    threads_before = torch.get_num_threads()
    assert main(["train", "r.yaml"]) == 0
    out = capsys.readouterr().out
    assert out.count("the CPU is oversubscribed") == 1, out
    assert torch.get_num_threads() == threads_before
