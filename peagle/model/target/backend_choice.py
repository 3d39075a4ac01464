"""Which backend runs the target, and the one place that opens it (``peagle extract``, ``peagle prompts``).

Both stages ask for a backend by the name their ``--backend`` flag holds (``auto``, ``hf``, ``vllm``)
and get a :class:`~peagle.model.target.backend.TargetBackend`; what differs between them is only
what they pass: extract its aux layers and top-k, prompts none (a backend that only generates).
Each backend takes the settings it has a use for and ignores the others, so a caller never branches
on the name. ``vllm`` is imported only when it is the one asked for: importing it costs seconds and,
on a machine with a broken install, fails.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from peagle.model.target.backend import TargetBackend
from peagle.model.target.directory import TargetDirectory
from peagle.schemas.errors import UserError


def resolve_backend_name(backend: str) -> str:
    """``auto`` is vllm when ``import vllm`` works (a broken install falls back to hf), else hf.

    Raises:
        UserError: ``vllm`` was asked for and is not installed.
    """
    if backend == "auto":
        if importlib.util.find_spec("vllm") is None:
            return "hf"
        try:
            import vllm  # noqa: F401  (a CPU box with a half-installed vllm must still extract)
        except Exception:
            return "hf"
        return "vllm"
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UserError("--backend vllm was asked for, but vllm is not installed (pip install peagle[vllm]; "
                        "or use --backend hf)")
    return backend


def open_backend(name: str, target: TargetDirectory, *, max_seq_len: int, aux_layer_ids: Sequence[int] = (),
                 topk: int = 1, dtype: str = "auto", generation_dtype: str | None = None, seed: int = 0,
                 device: str = "auto", generation: str = "auto", tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float | None = None,
                 engine_kwargs: dict[str, Any] | None = None) -> TargetBackend:
    """The backend ``name`` resolves to (:func:`resolve_backend_name`), loaded over ``target``.

    Args:
        name: ``auto``, ``hf`` or ``vllm``.
        max_seq_len: the longest sample it will be given (prompt and new tokens); vllm sizes its
            engine by it.
        aux_layer_ids: the HF ``hidden_states`` ids ``run`` returns; empty for a backend that only
            generates (vllm still checks one id, ``[1]``, and never uses it: only its plain
            generation engine starts).
        topk: log-probs kept per token by ``run``.
        dtype: the compute dtype (``auto``, ``float32``, ``bfloat16``).
        generation_dtype: the dtype ``generate`` writes in; None is ``dtype``.
        seed: vllm's engine seed (hf seeds each ``generate`` call instead).
        device, generation: hf only (its device; its KV cache for generation, ``GENERATION_MODES``).
        tensor_parallel_size, gpu_memory_utilization, engine_kwargs: vllm only (``vllm.LLM``'s).

    Raises:
        UserError: vllm asked for and not installed, or the backend refuses the target or settings.
    """
    answers_dtype = generation_dtype or dtype
    if resolve_backend_name(name) == "vllm":
        from peagle.model.target.vllm_backend import VllmBackend  # imports vllm: only when asked for

        return VllmBackend(target.path, aux_layer_ids=list(aux_layer_ids) or [1], topk=topk, dtype=dtype,
                           generation_dtype=answers_dtype, max_seq_len=max_seq_len, seed=seed,
                           tensor_parallel_size=tensor_parallel_size,
                           gpu_memory_utilization=gpu_memory_utilization, engine_kwargs=engine_kwargs)
    from peagle.model.target.hf_backend import HFBackend

    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    return HFBackend(target.path, aux_layer_ids=tuple(aux_layer_ids), topk=topk, dtype=dtype, device=device,
                     pad_token_id=pad, generation=generation, generation_dtype=answers_dtype)
