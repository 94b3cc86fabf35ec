"""The images of a data set checked once, when the trainer is built (docs/vlm.md, "What is checked").

`scan_images` reads the `image` / `images` column of each sized training and evaluation set, `SCAN_ROWS` rows at a
time, and refuses, with one line naming the data set, the row, the column and the fix:

- an image that is None, or a row of `images` with none;
- a string that is a URL (images are never fetched: nothing downloads at run time);
- a path to no file;
- anything PIL cannot open as an image (its header is read for every image: the format and the size);
- an image that cannot be decoded, for the first `DECODE_IMAGES` images of each set (`Image.load()`: a cut-off or
  damaged file; decoding costs ~3 ms per 448 x 448 JPEG, so every image only for sets of up to that many).

It returns an `ImageScan` holding the images of the most extreme shape (the widest or tallest aspect ratio, the
smallest side, the largest side), which `check_processor` gives to the model's image processor once it is known:
an image the processor refuses (Qwen-VL's aspect ratio of 200 or more) is then named by its row before training.
Streams are not scanned (they cannot be read before training); their rows are checked as they are drawn.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from typing import Any

from grpo.data import InputError, is_stream
from grpo.data.vision import error_line, image_column, is_processor, open_image

SCAN_ROWS = 1_000  # rows read at once (a column of 448 x 448 JPEGs: ~50 MB)
DECODE_IMAGES = 1_000  # images decoded in full per data set (every one has its header read)
NOT_FETCHED = "images are not fetched; download them first and give paths or PIL images"


class ImageScan:
    """What `scan_images` keeps for `check_processor`: per kind of extreme ("ratio", "small", "large") the image
    of a scanned set that holds it, as (measure, where, value, size). Truthy: the data has an image column."""

    def __init__(self) -> None:
        self.extremes: dict[str, tuple[float, str, Any, tuple[int, int]]] = {}

    def note(self, where: str, value: Any, size: tuple[int, int]) -> None:
        """Keep the image at `where` of `size` (width, height) if it is the most extreme so far."""
        width, height = size
        measures = {
            "ratio": max(width, height) / max(min(width, height), 1),
            "small": -min(width, height),
            "large": max(width, height),
        }
        for kind, measure in measures.items():
            if kind not in self.extremes or measure > self.extremes[kind][0]:
                self.extremes[kind] = (measure, where, value, size)

    def check_processor(self, processor: Any) -> None:
        """Give the processor's image processor each extreme image; a `ValueError` it raises (how the processors
        refuse an image) is refused naming the row. Any other error is the processor's own, and propagates."""
        if not is_processor(processor):
            return
        seen = set()
        for _, where, value, size in self.extremes.values():
            if where in seen:
                continue
            seen.add(where)
            try:
                processor.image_processor(images=[_opened(value).convert("RGB")], return_tensors="pt")
            except ValueError as error:  # how the processors refuse an image (Qwen-VL's aspect ratio, a size)
                raise InputError(
                    f"{where}: the model's processor refuses this {size[0]} x {size[1]} image "
                    f"({error_line(error)}). Resize or pad it, or drop the row."
                ) from error


def scan_images(*datasets: tuple[str, Any] | Any) -> ImageScan | None:
    """Check every image of `datasets` (train, eval: a data set, a dict of evaluation sets, or None) as the module
    docstring says; None when none has an image column."""
    scan, found = ImageScan(), False
    for name, dataset in _named(datasets):
        column = image_column(getattr(dataset, "column_names", None) or ())
        if column is None:
            continue
        found = True
        if not is_stream(dataset):
            _scan_column(dataset, name, column, scan)
    return scan if found else None


def _named(datasets) -> Iterator[tuple[str, Any]]:
    """(name, data set) of the trainer's train and eval sets, entry by entry for a dict of evaluation sets."""
    for name, dataset in zip(("train_dataset", "eval_dataset"), datasets):
        if isinstance(dataset, dict):
            yield from ((f"{name}[{key!r}]", value) for key, value in dataset.items())
        elif dataset is not None:
            yield name, dataset


def _scan_column(dataset: Any, name: str, column: str, scan: ImageScan) -> None:
    """Every image of `column`: opened, the first `DECODE_IMAGES` decoded; the first problem raised with a count."""
    problems, opened = [], 0
    for i, value in _undecoded_rows(dataset, column):
        images = [value] if column == "image" else (value or [])
        where = f"{name} row {i}, column {column!r}"
        if not images:
            problems.append((where, "holds no image: every row needs at least one (train text-only rows in a data "
                             "set without the column)"))  # fmt: skip
        for j, image in enumerate(images):
            at = where if column == "image" else f"{where} (image {j})"
            problem, size = _image_problem(image, decode=opened < DECODE_IMAGES)
            opened += 1
            if problem is not None:
                problems.append((at, problem))
            elif size is not None:
                scan.note(at, image, size)
    if problems:
        (at, problem), also = problems[0], f" ({len(problems)} bad in all)" if len(problems) > 1 else ""
        raise InputError(f"{at}: {problem}{also}.")


def _undecoded_rows(dataset: Any, column: str) -> Iterator[tuple[int, Any]]:
    """(row, value) of `column`, `SCAN_ROWS` rows at a time; a `datasets.Dataset` read in Arrow format, so that a
    `datasets.Image` column comes undecoded (`{"bytes", "path"}` dicts): decoding is this check's to do, so that a
    bad image is named by its row."""
    if not hasattr(dataset, "select_columns"):
        yield from ((i, dataset[i][column]) for i in range(len(dataset)))
        return
    rows = dataset.select_columns([column]).with_format("arrow")
    for start in range(0, len(rows), SCAN_ROWS):
        yield from enumerate(rows[start : start + SCAN_ROWS][column].to_pylist(), start)


def _image_problem(value: Any, decode: bool) -> tuple[str | None, tuple[int, int] | None]:
    """(what is wrong with one image and its fix, or None; its (width, height) when it opened)."""
    if isinstance(value, dict) and value.get("bytes") is None and value.get("path") is None:
        value = None
    if value is None:
        return "the image is None (missing): give every row its image, or drop the rows without one", None
    path = value if isinstance(value, str) else value.get("path") if isinstance(value, dict) else None
    if path is not None and (not isinstance(value, dict) or value.get("bytes") is None):
        if "://" in path:
            return f"{path[:80]!r} is a URL, and {NOT_FETCHED}", None
        if not os.path.isfile(path):
            return f"the file {path!r} does not exist: fix the path (relative paths are read from {os.getcwd()})", None
    try:
        image = _opened(value)
    except InputError as error:
        return str(error).rstrip("."), None
    except Exception as error:  # noqa: BLE001 - PIL raises OSError, ValueError, SyntaxError, ... on bad files
        return f"PIL cannot read it as an image ({error_line(error)}): replace it, or drop the row", None
    if decode:
        try:
            image.load()
        except Exception as error:  # noqa: BLE001 - a cut-off or damaged file, in any of PIL's decoders
            return f"the image cannot be decoded ({error_line(error)}): replace it, or drop the row", None
    return None, image.size


def _opened(value: Any):
    """A PIL image of `value` (a PIL image, a path, bytes or a `{"bytes", "path"}` dict), its header read only."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict) and value.get("bytes") is not None:
        return Image.open(io.BytesIO(value["bytes"]))
    return open_image(value, "the image")
