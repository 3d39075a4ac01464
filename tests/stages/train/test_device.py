"""Device choices (peagle/stages/train/device.py) asked with a CUDA device, on a machine without one.

The first GPU run died at ``torch.cuda.set_device(torch.device("cuda"))``, a line no CPU test reached;
these are the CUDA answers, checked here.
"""

from __future__ import annotations

import torch

from peagle.stages.train.device import (DevicePrefetcher, default_compute_dtype, pins_memory, resolve_device,
                                        uses_copy_stream, uses_fused_optimizer)

CUDA = torch.device("cuda", 0)


def test_a_cuda_device_always_gets_an_index():
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda", local_rank=3) == torch.device("cuda", 3)
    assert resolve_device(torch.device("cuda", 1), local_rank=3) == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None) == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))


def test_cuda_answers_without_a_gpu():
    cpu = torch.device("cpu")
    assert default_compute_dtype(CUDA) == torch.bfloat16
    assert default_compute_dtype(cpu, cpu_has_bf16=True) == torch.bfloat16  # AVX512-BF16 / AMX: native bf16 matmuls
    assert default_compute_dtype(cpu, cpu_has_bf16=False) == torch.float32  # emulated bf16 is slow
    assert uses_copy_stream(CUDA) and not uses_copy_stream(torch.device("cpu"))
    assert uses_fused_optimizer(CUDA) and not uses_fused_optimizer(torch.device("cpu"))
    assert pins_memory(CUDA) and not pins_memory(torch.device("cpu"))


def test_the_prefetcher_passes_batches_through_off_cuda():
    steps = [[object()], [object(), object()]]
    assert list(DevicePrefetcher(iter(steps), torch.device("cpu"))) == steps
