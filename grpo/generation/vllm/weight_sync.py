"""Moving the policy's weights from the trainer to a vLLM server, in buckets, with torch alone.

Both sides import this module: the trainer (`grpo/generation/vllm/client.py`) and the server's workers
(`grpo/generation/vllm/engine_processes.py`); it needs torch only, so the trainer never imports vLLM.

The transport is a process group of its own, apart from the trainer's data-parallel group: rank 0 is the trainer's
main process, ranks 1..N are the server's workers (tensor x data parallel). Its store (a `TCPStore`) lives with the
server's first worker, so the trainer needs to know only the server's host and a port. Backend: gloo on CPU, NCCL
between GPUs. The trainer broadcasts each bucket as a small header (names, dtypes, shapes) followed by its tensors,
straight from their memory, then an end marker; a thread on each worker receives the next bucket while the engine's
weight loader consumes the current one. The trainer holds at most two buckets (in its dtype cast, if any). A
layer's tensors may sit in different buckets: the engine processes a layer once all of its tensors arrived (vLLM's
layerwise reload), and every received tensor has its own memory until then.

Nothing received is unpickled: a header is JSON (names, dtype names, shapes) and tensors are raw bytes into freshly
allocated memory. The store has no authentication of its own; it listens on one address (not every interface, as
a plain `TCPStore` master does), and the first broadcast in a new group is a token the workers check
(`check_token`), so weights are accepted only from the rank 0 that holds it (docs/vllm.md#security).
"""

from __future__ import annotations

import datetime
import hmac
import json
import queue
import socket
import threading
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _header(bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> list[torch.Tensor]:
    """A bucket's first two broadcasts: [header length, tensor count] (int64), then the header (JSON: name, dtype,
    shape of each tensor). An empty bucket is the end marker: [0, 0]."""
    if not bucket:
        return [torch.zeros(2, dtype=torch.int64, device=device)]
    entries = [[name, dtype_name(tensor.dtype), list(tensor.shape)] for name, tensor in bucket]
    header = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.uint8).to(device)
    return [torch.tensor([header.numel(), len(bucket)], dtype=torch.int64, device=device), header]


def send_weights(
    group: dist.ProcessGroup,
    tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> tuple[int, int]:
    """Broadcast (name, tensor) pairs from rank 0 in buckets of about `bucket_bytes` (a larger tensor goes alone),
    cast to `dtype`: per bucket a header, then its tensors straight from their memory (no packing copy). The next
    bucket is gathered while this one is on the wire, so at most two are held. Returns (buckets, bytes) sent."""
    pending: list = []  # (work, tensor) of the bucket in flight; a tensor must live until its work is done
    count = total = 0

    def flush(bucket):
        nonlocal pending, count, total
        parts = _header(bucket, device) + [tensor for _, tensor in bucket]
        for work, _ in pending:
            work.wait()
        pending = [(group.broadcast(part, 0), part) for part in parts]
        count += bool(bucket)
        total += sum(t.numel() * t.element_size() for _, t in bucket)

    bucket, size = [], 0
    for name, tensor in tensors:
        tensor = tensor.detach().to(device=device, dtype=dtype or tensor.dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            flush(bucket)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        flush(bucket)
    flush([])  # the end marker
    for work, _ in pending:
        work.wait()
    return count, total


def receive_weights(group: dist.ProcessGroup, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs `send_weights` broadcasts, bucket by bucket, until its end marker. A thread receives
    the next bucket while the consumer works on this one. Every tensor is freshly allocated, so a consumer may keep
    it."""
    buckets: queue.Queue = queue.Queue(maxsize=1)

    def receive():
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            while True:
                sizes = torch.empty(2, dtype=torch.int64, device=device)
                broadcast(group, sizes)
                header_len, _ = sizes.tolist()
                if header_len == 0:
                    buckets.put(None)
                    return
                header = torch.empty(header_len, dtype=torch.uint8, device=device)
                broadcast(group, header)
                received = []
                for name, dtype, shape in json.loads(header.cpu().numpy().tobytes()):
                    tensor = torch.empty(shape, dtype=parse_dtype(dtype), device=device)
                    broadcast(group, tensor)
                    received.append((name, tensor))
                buckets.put(received)
        except Exception as e:  # handed to the consumer, which raises it
            buckets.put(e)

    threading.Thread(target=receive, daemon=True).start()
    while (item := buckets.get()) is not None:
        if isinstance(item, Exception):
            raise item
        yield from item


def open_store(
    host: str, port: int, world_size: int, is_master: bool, timeout: float, listen_host: str | None = None
) -> dist.TCPStore:
    """The group's `TCPStore`. The master listens on `listen_host` (default `host`) only: given no socket of its own,
    a `TCPStore` master listens on every interface whatever `host` says. Every member, the master included,
    connects to `host:port`."""
    delta = datetime.timedelta(seconds=timeout)
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=delta)
    listen_host = host if listen_host is None else listen_host
    family, kind, proto, _, address = socket.getaddrinfo(
        listen_host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a replaced group's port may be in TIME_WAIT
        listener.bind(address)
        listener.listen()
    except OSError as e:
        listener.close()
        raise OSError(f"the weight-sync store cannot listen on {listen_host}:{port} ({e}); pick another port") from e
    # The store owns the socket from here on (detach: Python must not close it under the store).
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        timeout=delta,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


def open_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout: float,
    listen_host: str | None = None,
) -> dist.ProcessGroup:
    """Join the weight-sync group as `rank` of `world_size`. Rank 1 (the server's first worker) hosts the store,
    listening on `listen_host` (default `host`); every rank connects to it at `host:port`. Blocks until all ranks
    have joined or `timeout` seconds."""
    delta = datetime.timedelta(seconds=timeout)
    store = open_store(host, port, world_size, rank == 1, timeout, listen_host)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, delta)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = delta
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"weight-sync backend {backend!r} is not 'gloo' or 'nccl'")


TOKEN_BYTES = 32


def send_token(group: dist.ProcessGroup, token: bytes, device: torch.device) -> None:
    """Rank 0's first broadcast in a new group: the token it sent the server over HTTP (`check_token`)."""
    broadcast(group, torch.frombuffer(bytearray(token), dtype=torch.uint8).to(device))


def check_token(group: dist.ProcessGroup, token: bytes, device: torch.device) -> None:
    """Receive rank 0's token and compare it, in constant time, with `token`; raise PermissionError if they differ
    (rank 0 is not the party that made the authenticated request)."""
    received = torch.empty(len(token), dtype=torch.uint8, device=device)
    broadcast(group, received)
    if not hmac.compare_digest(received.cpu().numpy().tobytes(), token):
        raise PermissionError(
            "weight-sync handshake failed: rank 0 of the group did not send the token of the /init_communicator "
            "request (another process joined the group's port first?); the group is dropped"
        )


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` from rank 0 (the trainer) to every rank of `group`, in place."""
    group.broadcast(tensor, 0).wait()
