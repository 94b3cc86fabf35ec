"""Two processes (gloo on CPU) against one: the same global batch must give the same update (docs/method.md)."""

from pathlib import Path

import pytest
import torch

from tests.helpers.compare import assert_same_update
from tests.helpers.distributed_update import EXTRA, LOSS_TYPES, VARIANTS, one_step
from tests.helpers.net import launch_two_processes

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.distributed
@pytest.mark.parametrize("per_device, accumulation", [(4, 1), (2, 2)])
def test_two_processes_match_one(tmp_path, per_device, accumulation):
    out_file = tmp_path / "two.pt"
    launch_two_processes(ROOT / "tests" / "helpers" / "distributed_update.py", out_file, per_device, accumulation)
    two = torch.load(out_file)
    # The global batch: 2 processes x per_device x accumulation rows = one process with twice the rows per step.
    # EXTRA: "lora" (a LoRA adapter, the reference its base) where peft is installed.
    for loss_type in (*LOSS_TYPES, *VARIANTS, *EXTRA):
        if loss_type == "top_entropy" and accumulation > 1:
            # The entropy threshold is per micro-step, and with accumulation the two layouts put different rows
            # in a micro-step (process p holds a contiguous block of the round), so only GA = 1 is comparable.
            continue
        update, world_size, loss, _ = two[loss_type]
        assert world_size == 2  # check the launcher really started two processes
        reference, _, reference_loss, params = one_step(loss_type, 2 * per_device, accumulation, str(tmp_path / "one"))
        assert sum(d.abs().sum() for d in reference.values()) > 0
        assert loss == pytest.approx(reference_loss, rel=1e-4, abs=1e-6), loss_type
        assert_same_update(update, reference, params, what=f"{loss_type} {per_device}x{accumulation}")


@pytest.mark.distributed
def test_two_processes_match_one_with_images(tmp_path):
    """Tiny vision-language models (Idefics3- and Qwen2-VL-shaped, tests/helpers/vlm.py): each process holds its rows'
    images, and the update of 2 processes x 2 rows equals 1 process x 4 rows, the KL term on. The completions log
    (`log_multimodal`) holds every row's image on the main process, as with 1 process."""
    from tests.helpers.vlm import one_vlm_step

    out_file = tmp_path / "two.pt"
    launch_two_processes(ROOT / "tests" / "helpers" / "vlm.py", out_file, 2, 1)
    two = torch.load(out_file)
    for kind in ("idefics3", "qwen2_vl"):
        update, world_size, loss, _, images = two[kind]
        assert world_size == 2
        reference, _, reference_loss, params, reference_images = one_vlm_step(kind, 4, 1, str(tmp_path / "one"))
        assert len(images) == 4 and images == reference_images
        assert sum(d.abs().sum() for d in reference.values()) > 0
        assert loss == pytest.approx(reference_loss, rel=1e-4, abs=1e-6), kind
        assert_same_update(update, reference, params, what=f"vlm {kind}")


@pytest.mark.distributed
def test_a_last_shorter_evaluation_batch_gives_the_same_metrics_with_two_processes(tmp_path):
    """7 held-out prompts, 2 rows a process: 2 processes evaluate a batch of 4 rows and a last one of 3 (split 1 / 2,
    no row given twice), 1 process batches of 2, 2, 2 and 1; each batch counts by its rows, so the metrics agree."""
    from tests.helpers.eval_two_processes import LOSS_TYPES, evaluate

    out_file = tmp_path / "two.pt"
    launch_two_processes(ROOT / "tests" / "helpers" / "eval_two_processes.py", out_file)
    results = torch.load(out_file)
    for loss_type in LOSS_TYPES:
        two, seen = results[loss_type]
        one, seen_alone = evaluate(str(tmp_path / loss_type), loss_type)
        assert sorted(seen) == sorted(seen_alone) == [f"Held out {i}" for i in range(7)]  # each prompt once
        assert set(two) == set(one) and one["eval_loss"] > 0 and one["eval_kl"] > 0
        for key, value in one.items():
            if key.endswith("/std"):  # a function's spread within each batch: it depends on how rows are batched
                continue
            assert two[key] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), f"{loss_type}: {key}"
