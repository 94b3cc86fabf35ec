"""Bad images are found when the trainer is built (issue 50; docs/vlm.md, "What is checked when the trainer is
built"): each one line naming the data set, the row, the column and the fix, before any step trains. Rows of a
stream, which cannot be read before training, are named by their prompt when a batch draws them."""

import io
import os

import pytest
from datasets import Dataset, Features, Image, List, Value

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import InputError, image_checks
from grpo.data.image_checks import scan_images
from grpo.data.vision import encode_vision_prompts, open_rows
from grpo.testing import squares_image, tiny_vlm, tiny_vlm_processor
from tests.helpers.scripted import TINY

PROMPT = [{"role": "user", "content": "How many squares?"}]
MESSAGES = List({"role": Value("string"), "content": Value("string")})


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    """Each test runs in its own temporary folder: relative image paths and the trainer's output_dir land there."""
    monkeypatch.chdir(tmp_path)


def png(image) -> bytes:
    """`image` as PNG file bytes."""
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def squares_with(bad, at: int | None = 1, rows: int = 4, column: str = "image") -> Dataset:
    """A data set of square images in a `datasets.Image` column (`images`: lists of one) whose row `at` (None: no
    row) holds `bad` instead, stored as the column stores it (None, a path or URL string, a {"bytes", "path"} dict)."""
    values = [{"bytes": png(squares_image(1 + i % 4, seed=i)), "path": None} for i in range(rows)]
    if at is not None:
        values[at] = bad
    if column == "images":
        values = [value if i == at else [value] for i, value in enumerate(values)]
    feature = Image() if column == "image" else List(Image())
    prompts = [[{"role": "user", "content": f"Row {i}: how many squares?"}] for i in range(rows)]
    return Dataset.from_dict(
        {"prompt": prompts, column: values}, features=Features(prompt=MESSAGES, **{column: feature})
    )


def build(train_dataset, kind: str = "idefics3", eval_dataset=None):
    """A trainer on a tiny VLM of `kind` with its processor; construction is what these tests check."""
    model, processor = tiny_vlm(kind=kind)
    args = GRPOConfig(output_dir="out", **{**TINY, "max_steps": 2, "save_steps": 1})
    return GRPOTrainer(model, lambda completions, **kw: [0.0] * len(completions), args=args,
                       train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processor)  # fmt: skip


def truncated_png() -> dict:
    """A PNG cut in half: its header opens, its pixels cannot be decoded."""
    data = png(squares_image(3, seed=7).resize((256, 256)))
    return {"bytes": data[: len(data) // 2], "path": None}


# (bad value in row 1, what the one line says). The first is bad case 6 of issue 50: it trained step 1, wrote a
# checkpoint, and died at step 2 with `UnidentifiedImageError` naming a BytesIO.
BAD_IMAGES = {
    "corrupt bytes": ({"bytes": b"\x89PNG but not really", "path": None}, "PIL cannot read it as an image"),
    "truncated file": (truncated_png(), "the image cannot be decoded (OSError: image file is truncated"),
    "None": (None, "the image is None (missing): give every row its image, or drop the rows without one"),
    "URL": ("https://example.org/squares.png", "images are not fetched; download them first and give paths or PIL"),
    "missing file": ("pictures/squares.png", "the file 'pictures/squares.png' does not exist: fix the path"),
}


@pytest.mark.parametrize("bad, message", BAD_IMAGES.values(), ids=BAD_IMAGES)
def test_a_bad_image_stops_the_trainer_before_training_naming_row_and_column(bad, message):
    with pytest.raises(InputError) as error:
        build(squares_with(bad, at=1))
    text = str(error.value)
    assert text.startswith("train_dataset row 1, column 'image': ") and message in text, text
    assert "\n" not in text and "BytesIO" not in text, text
    assert not os.path.exists("out") or not any(name.startswith("checkpoint") for name in os.listdir("out"))


def test_the_images_column_names_the_row_and_the_image():
    with pytest.raises(InputError, match=r"^train_dataset row 2, column 'images': holds no image: every row needs"):
        build(squares_with([], at=2, column="images"))
    with pytest.raises(InputError, match=r"^train_dataset row 1, column 'images' \(image 1\): the image is None"):
        build(squares_with([{"bytes": png(squares_image(1)), "path": None}, None], at=1, column="images"))


def test_the_evaluation_sets_are_checked_too():
    with pytest.raises(InputError, match=r"^eval_dataset\['hard'\] row 3, column 'image': PIL cannot read"):
        build(squares_with(None, at=None), eval_dataset={"hard": squares_with({"bytes": b"?", "path": None}, at=3)})


def test_paths_as_strings_are_opened_and_a_missing_one_named(tmp_path):
    paths = []
    for i in range(3):
        squares_image(1 + i, seed=i).save(tmp_path / f"{i}.png")
        paths.append(f"{i}.png")
    good = Dataset.from_dict({"prompt": [PROMPT] * 3, "image": paths})
    assert scan_images(good, None) is not None  # opens them all
    bad = Dataset.from_dict({"prompt": [PROMPT] * 3, "image": [paths[0], paths[1], "2.jpg"]})
    with pytest.raises(InputError, match=r"^train_dataset row 2, column 'image': the file '2.jpg' does not exist"):
        scan_images(bad, None)


def test_an_image_the_processor_refuses_is_named_at_construction():
    """Qwen-VL's processor refuses an aspect ratio of 200 or more (it raised "absolute aspect ratio must be smaller
    than 200" at the first batch, naming no row); Idefics3's resizes any shape, so the same data set is taken."""
    wide = {"bytes": png(squares_image(1).resize((4000, 10))), "path": None}
    with pytest.raises(InputError) as error:
        build(squares_with(wide, at=1), kind="qwen2_vl")
    text = str(error.value)
    assert text.startswith("train_dataset row 1, column 'image': the model's processor refuses this 4000 x 10 image")
    assert "aspect ratio must be smaller than 200" in text and "Resize or pad it, or drop the row" in text, text
    build(squares_with(wide, at=1), kind="idefics3")


def test_a_streams_rows_are_named_by_their_prompt_when_drawn():
    """A stream is not read when the trainer is built; a bad image in it is named by the row's prompt at the batch
    (the processor's refusal and an empty image list too), never by its place in the batch alone."""
    prompts = [[{"role": "user", "content": "Row 7: how many squares?"}]]
    with pytest.raises(InputError, match=r"Image 0 of the data set row whose prompt starts 'Row 7: how many"):
        open_rows([[b"not an image"]], prompts)
    processor = tiny_vlm_processor("qwen2_vl")
    with pytest.raises(InputError, match=r"refuses the images \(4000 x 10\) of the data set row whose prompt starts"):
        encode_vision_prompts(prompts, [[squares_image(1).resize((4000, 10))]], processor, max_prompt_length=None)
    with pytest.raises(InputError, match=r"An empty image column in the data set row whose prompt starts 'Row 7"):
        encode_vision_prompts(prompts, [[]], processor, max_prompt_length=None)


def test_a_stream_is_not_read_when_the_trainer_is_built():
    """A stream (`IterableDataset`) cannot be read before training, so its images are not scanned: building the
    trainer does not fail on row 1's bad image (the batch names it, above)."""
    stream = squares_with({"bytes": b"not an image", "path": None}, at=1).to_iterable_dataset()
    assert scan_images(stream, None) is not None  # an image column: a vision run
    assert build(stream).vision


def test_a_processor_loaded_from_the_models_path_is_given_the_extreme_images(tmp_path, monkeypatch):
    """Without `processing_class` the processor is loaded with the model (grpo.models.load_policy), and is then given
    the widest image as a passed one is. Idefics3's resizes any shape, so its image processor is made to refuse
    what Qwen-VL's does (an aspect ratio of 200 or more) for this test."""
    model, processor = tiny_vlm(kind="idefics3")
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    image_processor = type(processor.image_processor)

    def narrow_only(self, images, **kwargs):
        width, height = images[0].size
        if max(width, height) / min(width, height) >= 200:
            raise ValueError(
                f"absolute aspect ratio must be smaller than 200, got {max(width, height) / min(width, height)}"
            )
        return original(self, images, **kwargs)

    original = image_processor.__call__
    monkeypatch.setattr(image_processor, "__call__", narrow_only)
    wide = {"bytes": png(squares_image(1).resize((10, 4000))), "path": None}
    args = GRPOConfig(output_dir="out", **{**TINY, "max_steps": 1})
    with pytest.raises(
        InputError, match=r"^train_dataset row 2, column 'image': the model's processor refuses this 10 x 4000"
    ):
        GRPOTrainer(str(tmp_path / "vlm"), lambda completions, **kw: [0.0] * len(completions), args=args,
                    train_dataset=squares_with(wide, at=2))  # fmt: skip


def test_only_the_first_images_are_decoded(monkeypatch):
    """Past `DECODE_IMAGES` images only the header is read (decoding every image of a large set costs minutes,
    docs/vlm.md): a cut-off file there opens, and fails when a batch draws it, naming the row's prompt."""
    monkeypatch.setattr(image_checks, "DECODE_IMAGES", 1)
    assert scan_images(squares_with(truncated_png(), at=1), None) is not None
    monkeypatch.setattr(image_checks, "DECODE_IMAGES", 2)
    with pytest.raises(InputError, match="row 1, column 'image': the image cannot be decoded"):
        scan_images(squares_with(truncated_png(), at=1), None)
