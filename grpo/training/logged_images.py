"""`log_multimodal`: the images of the logged completions' prompts, saved beside the completions log.

A run on images with `log_completions` writes each prompt image once, as PNG, to `output_dir/completions_images/`,
named by a hash of its pixels, and each record of `completions.jsonl` lists its row's images by their path in
`output_dir` (`"images": ["completions_images/3f2a....png"]`). The G completions of a prompt, and the same image drawn
again in a later epoch, share one file, so the folder grows with the distinct images logged, not with the steps.

Images are written by the main process only: every process encodes its own rows' images (each distinct one once) and
the PNG bytes are gathered, so a run over several machines without a shared file system still logs them all. A file
is written under a temporary name and renamed into place, so a run killed mid-write never leaves a truncated image
under a final name.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Sequence

from accelerate.utils import gather_object

from grpo.data.vision import open_image

IMAGE_DIR = "completions_images"


def encode_rows(rows: Sequence[list | None]) -> tuple[list[list[str]], dict[str, bytes]]:
    """Each row's images (PIL images, paths, bytes or `datasets.Image` dicts) as file names, and the PNG bytes of
    each distinct image by its name. The name hashes the mode, size and pixels, so equal images share one file."""
    names, blobs = [], {}
    for i, row in enumerate(rows):
        row_names = []
        for j, value in enumerate(row or []):
            image = open_image(value, f"Image {j} of row {i}")
            digest = hashlib.sha256(f"{image.mode}:{image.size}:".encode() + image.tobytes()).hexdigest()[:24]
            name = f"{digest}.png"
            if name not in blobs:
                buffer = io.BytesIO()
                image.save(buffer, format="PNG")
                blobs[name] = buffer.getvalue()
            row_names.append(name)
        names.append(row_names)
    return names, blobs


def save_logged_images(output_dir: str, rows: Sequence[list | None], is_main: bool) -> list[list[str]] | None:
    """A collective call: this process's rows' images encoded, every process's gathered, and the files the folder
    lacks written by the main process. Returns, on the main process, each gathered row's image paths relative to
    `output_dir` (in gathered row order); None elsewhere."""
    names, blobs = encode_rows(rows)
    all_names, all_blobs = gather_object(names), gather_object([blobs])
    if not is_main:
        return None
    folder = os.path.join(output_dir, IMAGE_DIR)
    os.makedirs(folder, exist_ok=True)
    for process_blobs in all_blobs:
        for name, data in process_blobs.items():
            path = os.path.join(folder, name)
            if not os.path.exists(path):
                partial = f"{path}.partial-{os.getpid()}"
                with open(partial, "wb") as f:
                    f.write(data)
                os.replace(partial, path)
    return [[f"{IMAGE_DIR}/{name}" for name in row] for row in all_names]
