"""Moving the policy's weights from the trainer to a vLLM server, in buckets, with torch alone.

Both sides import this module: the trainer (`grpo/vllm_client.py`) and the server's workers
(`grpo/vllm_server.py`); it needs torch only, so the trainer never imports vLLM.

The transport is a process group of its own, apart from the trainer's data-parallel group: rank 0 is the trainer's
main process, ranks 1..N are the server's workers (tensor x data parallel). Its store (a `TCPStore`) lives with the
server's first worker, so the trainer needs to know only the server's host and a port. Backend: gloo on CPU, NCCL
between GPUs. The trainer broadcasts each bucket as a small header (names, dtypes, shapes, offsets) and one flat
byte buffer, then an end marker; the workers view each buffer back into tensors and stream them into the engine's
weight loader. The trainer holds one bucket at a time. A layer's tensors may sit in different buckets: the engine
processes a layer once all of its tensors arrived (vLLM's layerwise reload), and every bucket keeps its own buffer
until then.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

ALIGNMENT = 64  # bytes: every tensor starts at a multiple of this in a bucket, so its view has a legal offset


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _send(group: dist.ProcessGroup, bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> int:
    """Broadcast one bucket: its size and header length, its header (JSON: name, dtype, shape, offset, nbytes of
    each tensor), then all its bytes in one flat buffer. An empty bucket is the end marker. Returns its bytes."""
    entries, used = [], 0
    for name, tensor in bucket:
        offset = -(-used // ALIGNMENT) * ALIGNMENT
        nbytes = tensor.numel() * tensor.element_size()
        entries.append([name, dtype_name(tensor.dtype), list(tensor.shape), offset, nbytes])
        used = offset + nbytes
    header = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.uint8).to(device)
    broadcast(group, torch.tensor([header.numel() if bucket else 0, used], dtype=torch.int64, device=device))
    if not bucket:
        return 0
    broadcast(group, header)
    flat = torch.empty(used, dtype=torch.uint8, device=device)
    for (_, tensor), (_, _, _, offset, nbytes) in zip(bucket, entries):
        flat[offset : offset + nbytes].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
    broadcast(group, flat)
    return used


def send_weights(
    group: dist.ProcessGroup,
    tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> tuple[int, int]:
    """Broadcast (name, tensor) pairs from rank 0 in buckets of about `bucket_bytes` (a larger tensor goes alone),
    cast to `dtype`; only one bucket is held at a time. Returns (buckets, bytes) sent."""
    bucket, size, count, total = [], 0, 0, 0
    for name, tensor in tensors:
        tensor = tensor.detach().to(device=device, dtype=dtype or tensor.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            total, count, bucket, size = total + _send(group, bucket, device), count + 1, [], 0
        bucket.append((name, tensor))
        size += nbytes + ALIGNMENT
    if bucket:
        total, count = total + _send(group, bucket, device), count + 1
    _send(group, [], device)
    return count, total


def receive_weights(group: dist.ProcessGroup, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs `send_weights` broadcasts, bucket by bucket, until its end marker. Each tensor is a
    view into its bucket's own buffer (a fresh one per bucket, so a consumer may keep the views)."""
    while True:
        sizes = torch.empty(2, dtype=torch.int64, device=device)
        broadcast(group, sizes)
        header_len, used = sizes.tolist()
        if header_len == 0:
            return
        header = torch.empty(header_len, dtype=torch.uint8, device=device)
        broadcast(group, header)
        flat = torch.empty(used, dtype=torch.uint8, device=device)
        broadcast(group, flat)
        for name, dtype, shape, offset, nbytes in json.loads(header.cpu().numpy().tobytes()):
            yield name, flat[offset : offset + nbytes].view(parse_dtype(dtype)).view(shape)


def open_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout: float) -> dist.ProcessGroup:
    """Join the weight-sync group as `rank` of `world_size`. Rank 1 (the server's first worker) hosts the store;
    every other rank connects to it at `host:port`. Blocks until all ranks have joined or `timeout` seconds."""
    delta = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 1, timeout=delta, wait_for_workers=False)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, delta)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = delta
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"weight-sync backend {backend!r} is not 'gloo' or 'nccl'")


def broadcast(group: dist.ProcessGroup, flat: torch.Tensor) -> None:
    """Broadcast `flat` from rank 0 (the trainer) to every rank of `group`, in place."""
    group.broadcast(flat, 0).wait()
