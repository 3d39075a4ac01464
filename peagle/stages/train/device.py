"""Device choices of a training process, as functions of a ``torch.device`` that need no GPU to answer.

Every CUDA-specific decision (which device, which compute dtype, whether to copy on a side stream,
whether the optimizer is fused) is made here from the device alone, so the CPU tests call these
with ``torch.device("cuda", 0)`` and check the CUDA answers without a GPU; only the code that acts on
an answer touches CUDA. (The first GPU run stopped at a line no CPU test could reach:
``torch.cuda.set_device(torch.device("cuda"))`` refuses a device without an index.)

:class:`DevicePrefetcher` copies the next step's batches to the device on a side stream while the
current step runs (CUDA); elsewhere it passes batches through.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from peagle.model.cpu_bf16 import cpu_has_native_bf16


def resolve_device(name: str | torch.device | None = None, local_rank: int = 0) -> torch.device:
    """The device to train on, always with an index for CUDA (``cuda`` -> ``cuda:<local_rank>``).

    ``None`` is CUDA when one is available, else the CPU. ``torch.cuda.set_device`` and DDP's
    ``device_ids`` need the index; a bare ``cuda`` is what a user (or a benchmark flag) writes.
    """
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", local_rank)
    return device


def default_compute_dtype(device: torch.device, *, cpu_has_bf16: bool | None = None) -> torch.dtype:
    """bf16 autocast (and bf16 FSDP2 all-gathers) on CUDA, and on a CPU with native bf16 matmuls
    (AVX512-BF16 / AMX): there it trained the demo's draft 1.19x as fast as fp32 to the same held-out
    acceptance within seed noise (benchmarks/results/cpu/train_precision.json). fp32 on other CPUs,
    which emulate bf16 slowly. ``cpu_has_bf16`` None asks this machine's CPU."""
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu":
        native = cpu_has_native_bf16() if cpu_has_bf16 is None else cpu_has_bf16
        return torch.bfloat16 if native else torch.float32
    return torch.float32


def uses_copy_stream(device: torch.device) -> bool:
    """Host-to-device copies go on a side stream (overlapping the step) on CUDA only."""
    return device.type == "cuda"


def uses_fused_optimizer(device: torch.device) -> bool:
    """AdamW runs as one fused kernel (with the gradient clip folded in) on CUDA."""
    return device.type == "cuda"


def pins_memory(device: torch.device) -> bool:
    """Batches are page-locked for non-blocking copies when training on CUDA."""
    return device.type == "cuda"


class DevicePrefetcher:
    """Yields each item of ``source`` (a step's micro-batches) already on ``device``.

    On CUDA each step's batches are copied on a side stream: the host queues step i's kernels and
    moves on (a step has no host sync before the clip), so when it asks for step i+1's batches the GPU
    is still computing step i, and the copy runs beside it instead of queueing behind it on the
    compute stream. The compute stream waits for the copy on the device (an event: no host sync),
    and the copied tensors are recorded on the compute stream, so the allocator does not hand
    their memory out while it still reads them. On other devices batches pass through unchanged
    (``TrainStep`` copies them).
    """

    def __init__(self, source: Iterator[list[Any]], device: torch.device):
        self.source, self.device = source, device
        self.stream = torch.cuda.Stream(device) if uses_copy_stream(device) else None

    def __iter__(self) -> "DevicePrefetcher":
        return self

    def __next__(self) -> list[Any]:
        host_batches = next(self.source)
        if self.stream is None:
            return host_batches
        with torch.cuda.stream(self.stream):
            batches = [batch.to(self.device, non_blocking=True) for batch in host_batches]
            ready = torch.cuda.Event()
            ready.record(self.stream)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(ready)
        for batch in batches:
            batch.record_stream(compute)
        return batches
