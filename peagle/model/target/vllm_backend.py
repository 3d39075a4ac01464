"""The vLLM target backend: aux hidden states and top-k log-probs through a vLLM engine.

How it works (docs/store.md, docs/performance.md): the engine runs with the ``extract_hidden_states`` speculative method,
which caches per token the hidden stream at ``eagle_aux_hidden_state_layer_ids``; our connector
(``vllm_connector.py``) dumps each finished request's rows into one safetensors file in a staging
dir (``/dev/shm`` when it has room). Each request is a prefill plus one sampled token. We dump the
aux layers plus layer N, the final *pre-norm* state, and compute the top-k log-probs from it with
the target's own final RMSNorm and lm_head, loaded from its safetensors: this is ~10x faster than
``prompt_logprobs`` and gives full-vocab log-softmax values.

vLLM's layer ids are HF ``hidden_states`` ids for i < N; at i = N vLLM has the pre-norm state while
HF's ``hidden_states[N]`` is normed, which is why the head applies the norm itself.

Pitfalls this module handles:
* A killed driver leaves vLLM's engine processes running (holding the model, the KV cache, the GPU):
  ``EngineReaper`` stops them.
* The engine must run in its own process: in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the last
  request's dump is never written.
* On a CPU build the KV-cache size is set explicitly, else vLLM asks for 92% of RAM and refuses to
  start when that much is not free.
* Prefix caching is off, so every token's state comes from its own request's forward.
* vLLM writes LD_PRELOAD, LOCAL_WORLD_SIZE, ... into ``os.environ`` for its children; we undo it.

Shape legend: T tokens of one sample, N target layers, L dumped layers, A aux layers,
H hidden size, V target vocab, K top-k.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch

from peagle.model.target.directory import TargetWeights, text_config_dict
from peagle.pipeline.progress import library_bars_enabled
from peagle.schemas.errors import UserError, one_line
from peagle.model.target.backend import TargetOutput

# The staging dir holds the dumps of one engine call at a time; a call is split so that its dumps
# take at most this share of the staging filesystem's free space.
_STAGING_SHARE = 0.5
# Logit rows are computed in chunks of at most this many bytes of fp32 [rows, V].
_HEAD_CHUNK_BYTES = 256 << 20
_CPU_KV_CACHE_BYTES = 1 << 30
_SHUTDOWN_TIMEOUT_S = 1.0

_NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")
_LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")
_EMBED_KEYS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
)


@contextlib.contextmanager
def _environ_kept() -> Iterator[None]:
    """Undo what vLLM writes into ``os.environ`` (LD_PRELOAD, LD_LIBRARY_PATH, LOCAL_WORLD_SIZE,
    VLLM_WORKER_MULTIPROC_METHOD, ...): meant for its own processes, it must not leak into the
    subprocesses and libraries this process uses afterwards (e.g. the rest of a test session)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        if dict(os.environ) != saved:
            os.environ.clear()
            os.environ.update(saved)


_CPU_STEP_TIMEOUT_S = "3600"
"""``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` on a CPU unless the environment sets it. vLLM's 300 s
default killed a regeneration on a busy 2-core box: one step of 32 prompts of 1,024 tokens ran
longer than that under load, and the engine died with a traceback instead of being slow."""


def _engine_death_in_one_line(method: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's engine process dying (killed, out of memory, a step over its time limit) ends in one
    line: the shards committed so far are on disk and the same command resumes after them. The dead
    engine is let go, so a later call on the same backend starts another."""
    @functools.wraps(method)
    def wrapped(self: "VllmBackend", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as err:
            if not any(cls.__name__ == "EngineDeadError" for cls in type(err).__mro__):
                raise
            with contextlib.suppress(Exception):  # its processes are gone or going; the reaper ends the rest
                self._shutdown_engine()
            timeout = os.environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "its default")
            raise UserError(f"vLLM's engine stopped ({one_line(err, 200)}); "
                            f"the shards committed so far are kept: run the same command again to resume (a "
                            f"step slower than VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, {timeout}, also stops it)") from err
    return wrapped


class TargetHead:
    """The target's final RMSNorm + lm_head, turning pre-norm final states into top-k log-probs.

    Numerics follow transformers' Llama/Qwen RMSNorm: normalise in fp32, cast to the compute dtype,
    scale by the weight; logits in the compute dtype, log-softmax in fp32 over the full vocab.
    """

    def __init__(self, target_dir: Path, *, dtype: torch.dtype, device: torch.device) -> None:
        config = text_config_dict(target_dir)
        unsupported = [k for k in ("final_logit_softcapping", "logit_scale", "logits_scaling") if config.get(k)]
        if unsupported or str(config.get("model_type", "")).startswith("gemma"):
            raise UserError(
                f"target {target_dir} has a final norm/head the vllm backend does not reproduce "
                f"({config.get('model_type')}, {unsupported}); use --backend hf"
            )
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.dtype = dtype
        self.device = device
        weights = TargetWeights(target_dir)
        head_keys = _LM_HEAD_KEYS + (_EMBED_KEYS if config.get("tie_word_embeddings") else ())
        self.norm_H = weights.read_first(_NORM_KEYS).to(device, dtype)
        self.lm_head_VH = weights.read_first(head_keys).to(device, dtype)

    @property
    def vocab_size(self) -> int:
        return self.lm_head_VH.shape[0]

    def norm(self, hidden_TH: torch.Tensor) -> torch.Tensor:
        x = hidden_TH.to(self.device, torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm_H * x.to(self.dtype)

    @torch.inference_mode()
    def topk(self, prenorm_TH: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (ids int32, log-probs float32) of every row, descending, on the CPU."""
        rows = max(1, _HEAD_CHUNK_BYTES // (4 * self.vocab_size))
        ids, logprobs = [], []
        for chunk_TH in prenorm_TH.split(rows):
            logits_TV = (self.norm(chunk_TH) @ self.lm_head_VH.T).float()
            top = torch.log_softmax(logits_TV, dim=-1).topk(k, dim=-1)
            ids.append(top.indices.to("cpu", torch.int32))
            logprobs.append(top.values.cpu())
        return torch.cat(ids), torch.cat(logprobs)


class VllmBackend:
    """A vLLM engine over the target that yields ``TargetOutput``s (see ``TargetBackend``).

    Two engines exist, one at a time, each started on first use: the extraction engine (``run``)
    and a plain one (``generate``). Random sampling through the extraction engine is wrong in
    vLLM 0.32 (its "draft" is the last sampled token: seeds are not honoured and a near-uniform
    target repeated one token 8 times), and on a GPU the two engines cannot share the memory, so
    switching costs an engine start: regenerate a whole shard (or the whole input) before
    extracting it.

    Args:
        target_dir: local HF model directory (config.json + safetensors).
        aux_layer_ids: HF ``hidden_states`` ids, strictly ascending, each in [1, N).
        topk: how many log-probs to keep per token.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"auto"`` (vLLM's choice); also the head's dtype.
        generation_dtype: the plain engine's dtype (``generate``: the text ``--regenerate`` writes);
            ``None`` is ``dtype``. The two engines never run at once, so a bf16 writer costs
            nothing beside a float32 extractor, and on a CPU with native bf16 it writes ~1.5x faster
            (SmolLM2 on 2 cores: 536 against 352 new tokens/s, regenerate_throughput_vllm.json).
        max_seq_len: the longest sample ``run`` or ``generate`` will be given (prompt + new tokens).
        tensor_parallel_size, gpu_memory_utilization, enforce_eager, seed: passed to ``vllm.LLM``
            (``enforce_eager`` defaults to True on CPU, where graph compilation only costs time).
        engine_kwargs: any further ``vllm.LLM`` keyword arguments (they win over ours).
        staging_dir: where the connector writes dumps; default a fresh ``StagingDir`` (on
            ``/dev/shm`` when it has ≥ 1 GiB free), removed by ``close`` or, after a crash, by the
            next run.
        head_device: where the top-k head runs; default ``cuda`` when available, else ``cpu``.

    Raises:
        UserError: bad layer ids, vLLM not importable, unsupported head, in-process engine mode.
    """

    name = "vllm"

    @_environ_kept()
    def __init__(
        self,
        target_dir: str | Path,
        *,
        aux_layer_ids: list[int],
        topk: int,
        dtype: str = "auto",
        generation_dtype: str | None = None,
        max_seq_len: int = 2048,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        enforce_eager: bool | None = None,
        seed: int = 0,
        engine_kwargs: dict[str, Any] | None = None,
        staging_dir: str | Path | None = None,
        head_device: str | None = None,
    ) -> None:
        try:
            import vllm
            from vllm.platforms import current_platform
        except Exception as err:  # a broken install raises more than ImportError
            raise UserError(f"--backend vllm: vllm does not import ({type(err).__name__}: {err})") from err
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            raise UserError("--backend vllm needs VLLM_ENABLE_V1_MULTIPROCESSING unset or 1 (in-process "
                            "engines never write the last hidden-states dump)")
        self._vllm = vllm
        self.target_dir = Path(target_dir)
        config = text_config_dict(self.target_dir)
        self.num_layers = int(config["num_hidden_layers"])
        self.hidden_size = int(config["hidden_size"])
        self.aux_layer_ids = list(aux_layer_ids)
        ids = self.aux_layer_ids
        if not (ids and all(a < b for a, b in zip(ids, ids[1:])) and 1 <= ids[0] and ids[-1] < self.num_layers):
            raise UserError(
                f"aux layer ids {self.aux_layer_ids} must be strictly ascending in [1, {self.num_layers}) "
                f"for a {self.num_layers}-layer target"
            )
        if not 0 < topk <= int(config["vocab_size"]):
            raise UserError(f"--topk {topk} must be in [1, target vocab {config['vocab_size']}]")
        self.topk = topk
        self.max_seq_len = max_seq_len
        # vLLM hands back the dumped layers in ascending order: the aux layers, then N.
        self._dump_ids = [*self.aux_layer_ids, self.num_layers]
        from peagle.model.target.vllm_connector import StagingDir

        self._owned_staging = StagingDir() if staging_dir is None else None
        self.staging_dir = self._owned_staging.path if self._owned_staging else Path(staging_dir)
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        self._head_device = torch.device(head_device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._head: TargetHead | None = None

        on_cpu = self._on_cpu = current_platform.is_cpu()
        self._common_kwargs: dict[str, Any] = dict(
            model=str(self.target_dir),
            dtype=dtype,
            max_model_len=max_seq_len + 1,  # room for the one token every extraction request samples
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
            enable_prefix_caching=False,
            seed=seed,
            use_tqdm_on_load=library_bars_enabled(),
        )
        if gpu_memory_utilization is not None:
            self._common_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if on_cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            self._common_kwargs["kv_cache_memory_bytes"] = _CPU_KV_CACHE_BYTES
        self._generation_dtype = generation_dtype or dtype
        self._engine_kwargs = dict(engine_kwargs or {})
        self._llm: Any = None
        self._llm_kind: str | None = None
        self._reaper: Any = None

    @_environ_kept()
    @_engine_death_in_one_line
    def run(self, token_ids: list[list[int]]) -> list[TargetOutput]:
        """One ``TargetOutput`` per sample, in order (aux in the engine dtype, top-k on the CPU)."""
        for ids in token_ids:
            if not 0 < len(ids) <= self.max_seq_len:
                raise ValueError(f"sample of {len(ids)} tokens outside [1, max_seq_len={self.max_seq_len}]")
        if not token_ids:
            return []
        self._engine("extract")
        outputs: list[TargetOutput] = []
        for group in self._groups_that_fit(token_ids):
            outputs.extend(self._run_group(group))
        return outputs

    @_environ_kept()
    @_engine_death_in_one_line
    def generate(
        self,
        prompts_token_ids: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> list[list[int]]:
        """The target's own continuations (for ``--regenerate``), in order.

        Each prompt gets its own seed (``seed + index``), so a continuation does not depend on
        which other prompts share the call. The stop token (EOS) is not part of the result, as in
        ``HFBackend.generate``. Keep ``len(prompt) + max_new_tokens`` within ``max_seq_len``.
        """
        from vllm.inputs import TokensPrompt

        llm = self._engine("generate")
        params = [
            self._vllm.SamplingParams(
                max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                seed=(seed + i) % (1 << 63), detokenize=False,
            )
            for i in range(len(prompts_token_ids))
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts_token_ids]
        results = llm.generate(prompts, params, use_tqdm=False)
        completions = []
        for result in results:
            out = result.outputs[0]
            ids = list(out.token_ids)
            # finish_reason "stop" means the last id is EOS or a stop token id ("length": no stop)
            completions.append(ids[:-1] if out.finish_reason == "stop" else ids)
        return completions

    def close(self) -> None:
        """Stop the engine processes and remove the staging dir (if we made it)."""
        self._shutdown_engine()
        if self._owned_staging is not None:
            self._owned_staging.close()

    # -- internals ---------------------------------------------------------------------------

    def _engine(self, kind: str) -> Any:
        """The engine for ``kind`` ("extract" or "generate"), started if another one is running."""
        if self._llm_kind == kind:
            return self._llm
        self._shutdown_engine()
        kwargs = self.engine_kwargs(kind)
        from peagle.model.target.vllm_reaper import EngineReaper

        self._reaper = EngineReaper()  # before the engine starts: a kill mid-start must not orphan it
        if self._on_cpu:  # read by the engine's processes; os.environ is restored after run/generate
            os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", _CPU_STEP_TIMEOUT_S)
        self._llm = self._vllm.LLM(**kwargs)
        self._llm_kind = kind
        if self._head is None and kind == "extract":
            dtype = self._llm.llm_engine.model_config.dtype
            self._head = TargetHead(self.target_dir, dtype=dtype, device=self._head_device)
        return self._llm

    def engine_kwargs(self, kind: str) -> dict[str, Any]:
        """``vllm.LLM``'s keyword arguments for the engine of ``kind`` ("extract" or "generate")."""
        kwargs = dict(self._common_kwargs)
        if kind == "extract":
            from peagle.model.target import vllm_connector

            kwargs["speculative_config"] = {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self._dump_ids}},
            }
            kwargs["kv_transfer_config"] = {
                "kv_connector": vllm_connector.CONNECTOR_NAME,
                "kv_connector_module_path": vllm_connector.MODULE_PATH,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self.staging_dir)},
            }
        elif not torch.cuda.is_available():
            # vLLM 0.32 on CPU crashes ("CPU Generator does not use offset") when a seeded request's
            # prefill is split over two steps: it rewinds the request's generator, which CPU generators
            # cannot do. A step budget that holds every running sequence whole never splits a prefill.
            kwargs["max_num_seqs"] = 32
            kwargs["max_num_batched_tokens"] = 32 * int(kwargs.get("max_model_len") or 2048)
        if kind == "generate":
            kwargs["dtype"] = self._generation_dtype
        kwargs.update(self._engine_kwargs)
        return kwargs

    def _shutdown_engine(self) -> None:
        """Stop the engine; the backend forgets it and its reaper even if stopping it raises (a dead one)."""
        llm, reaper = self._llm, self._reaper
        self._llm = self._llm_kind = self._reaper = None
        try:
            if llm is not None:
                # vLLM waits 5 s for its worker before killing it; everything we need is read already.
                llm.llm_engine.engine_core.shutdown(timeout=_SHUTDOWN_TIMEOUT_S)
        finally:
            if reaper is not None:
                reaper.close()

    def _groups_that_fit(self, token_ids: list[list[int]]) -> list[list[list[int]]]:
        """Split a call so that one group's dumps use at most half the staging space left."""
        assert self._head is not None
        bytes_per_token = len(self._dump_ids) * self.hidden_size * self._head.dtype.itemsize
        budget = _STAGING_SHARE * shutil.disk_usage(self.staging_dir).free
        groups: list[list[list[int]]] = [[]]
        used = 0
        for ids in token_ids:
            need = len(ids) * bytes_per_token
            if groups[-1] and used + need > budget:
                groups.append([])
                used = 0
            groups[-1].append(ids)
            used += need
        return groups

    def _run_group(self, token_ids: list[list[int]]) -> list[TargetOutput]:
        from vllm.inputs import TokensPrompt

        from peagle.model.target.vllm_connector import read_hidden_states

        assert self._head is not None and self._llm_kind == "extract"
        params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in token_ids]
        results = self._llm.generate(prompts, params, use_tqdm=False)
        dumps_TLH = []
        for ids, result in zip(token_ids, results, strict=True):
            tensors = read_hidden_states(result.kv_transfer_params["hidden_states_path"])
            if tensors["token_ids"].tolist() != list(ids):  # order or truncation went wrong
                raise RuntimeError(f"vLLM dump of request {result.request_id} holds other tokens than sent")
            dumps_TLH.append(tensors["hidden_states"])
        ids_TK, logprobs_TK = self._head.topk(torch.cat([d[:, -1] for d in dumps_TLH]), self.topk)
        lengths = [d.shape[0] for d in dumps_TLH]
        outputs = []
        for dump_TLH, ids_part, lp_part in zip(dumps_TLH, ids_TK.split(lengths), logprobs_TK.split(lengths)):
            aux_TAH = dump_TLH[:, :-1].contiguous()  # drop layer N: only the head needed it
            outputs.append(TargetOutput(aux_TAH=aux_TAH, topk_ids_TK=ids_part, topk_logprobs_TK=lp_part))
        return outputs
