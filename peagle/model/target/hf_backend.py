"""The transformers backend: aux hidden states and full-vocab top-k log-probs from a HF causal LM.

One ``run`` is one forward pass of the model body over a right-padded batch, with no attention
mask: under causal attention a real token never sees the padding to its right, so the rows of real
tokens are exactly what the sample alone would give (positions count from 0 for every row), and the
mask-free SDPA path is the fast one. The aux states are caught by forward pre-hooks on the decoder
layers (the tensor entering layer i is HF ``hidden_states[i]``), so only A of the N+1 states are
kept alive. Top-k log-probs come from the lm_head over the body's final (normed) state, a bounded
number of tokens at a time so a 150k vocab never materialises ``[B, L, V]``.

Results are bit-identical across runs for the same batch (same shapes, same kernels, same thread
count, which the driver fixes); the driver fixes the batches.

Shape legend: B batch, L padded length, T real tokens, A aux layers, H hidden, V vocab, K top-k.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from peagle.model.cpu_bf16 import cpu_has_native_bf16
from peagle.model.target.directory import load_causal_lm
from peagle.model.target.backend import TargetOutput
from peagle.schemas.errors import UserError
from peagle.schemas.extract_config import GENERATION_MODES

# Budget for one chunk of fp32 logits (tokens * V * 4 bytes): bounds the top-k step's memory.
LOGITS_CHUNK_BYTES = 256 << 20
GENERATE_WIDTH_STEP = 64
"""Compiled generation pads prompts to a multiple of this many tokens (one compiled shape per step)."""
# How generation keeps its KV cache (GENERATION_MODES). ``dynamic``: transformers' growing cache, which copies every
# layer's cache at each step (fine on a CPU, where the attention is the cost). ``static``: one
# preallocated cache written in place; on a GPU at large batches the step is bound by reading the
# cache, so this is the fast one without any compile. ``compiled``: static plus a compiled decode step
# (CUDA graphs), which pays where steps are launch-bound (small batches) and costs a compile per
# process. ``auto``: static on CUDA, dynamic elsewhere.


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on GPU and float32 on CPU (bf16 matmuls on CPU are slow and rarely used)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def resolve_generation_dtype(dtype: str, compute: torch.dtype, device: torch.device, *,
                             cpu_has_bf16: bool | None = None) -> torch.dtype:
    """``auto`` is bfloat16 where a float32 target runs on a CPU with native bf16 matmuls, else the
    compute dtype. There bf16 writes ~1.5x faster (vLLM: 536 against 352 new tokens/s on 2 cores,
    regenerate_throughput_vllm.json) and drafts trained on its answers accept as much as on float32's
    (within seed noise, generation_dtype_acceptance.json), although its greedy text parts from
    float32's (SmolLM2: at token 38 in the median, generation_dtype_agreement.json): the answers are
    training data, not the served target's output. The states always come from ``compute``.
    ``cpu_has_bf16`` None asks this machine's CPU."""
    if dtype != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if compute == torch.float32 and device.type == "cpu":
        native = cpu_has_native_bf16() if cpu_has_bf16 is None else cpu_has_bf16
        return torch.bfloat16 if native else torch.float32
    return compute


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder layer list of a HF causal LM (``model.model.layers`` for Llama, Qwen, Mistral, ...)."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(body, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UserError(f"unsupported target architecture {type(model).__name__}: no decoder `layers` list")
    return layers


def topk_logprobs(hidden_TH: torch.Tensor, lm_head: torch.nn.Module, topk: int, *,
                  softcap: float | None = None, chunk_bytes: int = LOGITS_CHUNK_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``log_softmax(lm_head(hidden))`` over the full vocab, ``chunk`` tokens at a time.

    log_softmax is monotone in the logits, so the top-k ids are the logits' top-k and their
    log-probs are ``logit - logsumexp(logits)``: the full ``[T, V]`` log-softmax is never built.
    Returns ``(ids_TK int32, logprobs_TK float32)``, descending by log-prob.
    """
    num_tokens = hidden_TH.shape[0]
    vocab = lm_head.weight.shape[0]
    chunk = max(1, chunk_bytes // (vocab * 4))
    ids_TK = torch.empty((num_tokens, topk), dtype=torch.int32, device=hidden_TH.device)
    logprobs_TK = torch.empty((num_tokens, topk), dtype=torch.float32, device=hidden_TH.device)
    for start in range(0, num_tokens, chunk):
        logits_CV = lm_head(hidden_TH[start:start + chunk])  # model dtype, as vLLM computes them
        if softcap is not None:  # Gemma-2 style final logit soft-capping
            logits_CV = torch.tanh(logits_CV.float() / softcap) * softcap
        # Up-casting is exact, so the top-k of the model-dtype logits is the top-k of the fp32 ones
        # (half the memory traffic for bf16); only logsumexp needs fp32.
        values_CK, ids_CK = logits_CV.topk(topk, dim=-1)
        logprobs_TK[start:start + chunk] = values_CK.float() - logits_CV.float().logsumexp(dim=-1, keepdim=True)
        ids_TK[start:start + chunk] = ids_CK
    return ids_TK, logprobs_TK


@dataclass
class InFlight:
    """A submitted batch: host tensors (being filled on CUDA until ``done``) and per-sample lengths."""

    lengths: list[int]
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # aux_TAH, ids_TK, logprobs_TK
    done: Any  # torch.cuda.Event or None (CPU: already complete)
    keep: tuple  # device tensors that must outlive the copy


class HFBackend:
    """A HF causal LM loaded for extraction (``TargetBackend``) and for ``--regenerate``."""

    name = "hf"

    def __init__(self, model_dir: str | os.PathLike, *, aux_layer_ids: tuple[int, ...], topk: int,
                 dtype: str = "auto", device: str = "auto", pad_token_id: int = 0,
                 generation: str = "auto", generation_dtype: str = "auto") -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model = load_causal_lm(model_dir, self.dtype, self.device)
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.topk = topk
        self.pad_token_id = pad_token_id
        config = self.model.config
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        if topk > self.vocab_size:
            raise UserError(f"--topk {topk} is larger than the target vocab ({self.vocab_size})")
        self.softcap = getattr(config, "final_logit_softcapping", None)
        layers = decoder_layers(self.model)
        # No aux layers: a backend that only generates (``peagle prompts``, regeneration alone).
        assert not self.aux_layer_ids or self.aux_layer_ids[-1] < len(layers), "aux ids are checked first"
        self._captured: dict[int, torch.Tensor] = {}
        self._layers = layers
        on_gpu = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if on_gpu else None
        self.chunk_bytes = LOGITS_CHUNK_BYTES * (4 if on_gpu else 1)
        if generation not in GENERATION_MODES:
            raise UserError(f"generation must be one of {'|'.join(GENERATION_MODES)}, got {generation!r}")
        self.generation = ("static" if on_gpu else "dynamic") if generation == "auto" else generation
        """How ``generate`` keeps its KV cache (:data:`GENERATION_MODES`)."""
        self.generation_dtype = resolve_generation_dtype(generation_dtype, self.dtype, self.device)
        self._generation_model = self.model if self.generation_dtype == self.dtype else None
        self.generation_notes: list[str] = []
        """One line per thing generation had to give up (a failed compile), for the caller to print."""

    @contextlib.contextmanager
    def _capturing(self):
        """The aux capture hooks, live only inside an extraction forward: generation runs without
        them (a hook per layer call costs time on CPU and breaks a compiled decode step's graph)."""
        hooks = [self._layers[i].register_forward_pre_hook(self._capture_hook(i), with_kwargs=True)
                 for i in self.aux_layer_ids]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
            self._captured.clear()

    def _capture_hook(self, layer_id: int):
        def hook(module, args, kwargs):
            self._captured[layer_id] = args[0] if args else kwargs["hidden_states"]
        return hook

    @torch.inference_mode()
    def body_forward(self, input_ids_BL: torch.Tensor) -> torch.Tensor:
        """The model body's forward (no lm_head): the final normed state ``[B, L, H]``. This is also
        the "bare prefill" the throughput benchmark compares against."""
        return self.model.get_decoder()(input_ids=input_ids_BL, use_cache=False).last_hidden_state

    @torch.inference_mode()
    def submit(self, token_ids: list[list[int]]) -> "InFlight":
        """Queue one fixed batch on the device and return at once (on CUDA the work and the copy to
        host run asynchronously: the driver queues the next batch before collecting this one, so the
        copy overlaps the next forward). On CPU the work is done when this returns."""
        lengths = [len(ids) for ids in token_ids]
        width = max(lengths)
        input_ids_BL = torch.full((len(token_ids), width), self.pad_token_id, dtype=torch.long)
        for b, ids in enumerate(token_ids):
            input_ids_BL[b, :len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        # Flat rows of the real tokens, in sample order (an index gather: a boolean mask would sync).
        rows_T = torch.cat([torch.arange(n) + b * width for b, n in enumerate(lengths)])
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            input_ids_BL, rows_T = input_ids_BL.pin_memory(), rows_T.pin_memory()
        input_ids_BL = input_ids_BL.to(self.device, non_blocking=True)
        rows_T = rows_T.to(self.device, non_blocking=True)
        with self._capturing():
            final_BLH = self.body_forward(input_ids_BL)
            aux_BLAH = torch.stack([self._captured[i] for i in self.aux_layer_ids], dim=2)
        aux_TAH = aux_BLAH.flatten(0, 1).index_select(0, rows_T).to(torch.bfloat16)
        ids_TK, logprobs_TK = topk_logprobs(final_BLH.flatten(0, 1).index_select(0, rows_T),
                                            self.model.get_output_embeddings(), self.topk, softcap=self.softcap,
                                            chunk_bytes=self.chunk_bytes)
        if not on_gpu:
            return InFlight(lengths=lengths, host=(aux_TAH, ids_TK, logprobs_TK), done=None, keep=())
        # Copy to pinned host memory on a side stream, after the compute stream's work so far.
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                         for t in (aux_TAH, ids_TK, logprobs_TK))
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        return InFlight(lengths=lengths, host=host, done=done, keep=(aux_TAH, ids_TK, logprobs_TK))

    def collect(self, in_flight: "InFlight") -> list[TargetOutput]:
        """Wait for a submitted batch; its outputs as CPU tensors (pageable: pinned staging is reused)."""
        host = in_flight.host
        if in_flight.done is not None:
            in_flight.done.synchronize()
            host = tuple(t.clone() for t in host)  # let the pinned block go back to the cache
        aux_TAH, ids_TK, logprobs_TK = host
        outputs, start = [], 0
        for n in in_flight.lengths:
            outputs.append(TargetOutput(aux_TAH=aux_TAH[start:start + n], topk_ids_TK=ids_TK[start:start + n],
                                        topk_logprobs_TK=logprobs_TK[start:start + n]))
            start += n
        return outputs

    def run(self, token_ids: list[list[int]]) -> list[TargetOutput]:
        """Aux states and top-k for each sample of one fixed batch, in order (CPU tensors)."""
        return self.collect(self.submit(token_ids))

    @torch.inference_mode()
    def generate(self, prompts_token_ids: list[list[int]], *, max_new_tokens: int, temperature: float,
                 top_p: float, seed: int, stop_token_ids: list[int] | None = None) -> list[list[int]]:
        """The target's own continuation of each prompt (without the stop token), one fixed batch.

        Left padding with an attention mask, as decoder-only generation needs. Sampling draws from
        the global torch RNG, seeded here, so a fixed batch with a fixed seed regenerates the same text.
        ``generation`` picks the cache (:data:`GENERATION_MODES`); if compiling fails, this backend
        says why once (``generation_notes``) and generates with a static cache, uncompiled, from then on.
        """
        if self.generation == "compiled":
            try:
                return self._generate(prompts_token_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_p=top_p, seed=seed, stop_token_ids=stop_token_ids)
            except Exception as exc:  # a compiler or cache failure must not cost the run: eager still works
                self.generation = "static"
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                self.generation_notes.append(f"compiled generation failed ({type(exc).__name__}: {first}); "
                                             "generating uncompiled")
        return self._generate(prompts_token_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, seed=seed, stop_token_ids=stop_token_ids)

    def generation_model(self) -> Any:
        """The model that writes answers: the extraction model itself, or (another dtype) a copy of
        it made on first use, so the states are still computed in ``dtype``."""
        if self._generation_model is None:
            import copy

            self._generation_model = copy.deepcopy(self.model).to(self.generation_dtype)
        return self._generation_model

    def _generate(self, prompts_token_ids: list[list[int]], *, max_new_tokens: int, temperature: float,
                  top_p: float, seed: int, stop_token_ids: list[int] | None) -> list[list[int]]:
        gen_config = self.generation_model().generation_config
        stops = list(stop_token_ids or _as_list(gen_config.eos_token_id))
        num_prompts = len(prompts_token_ids)
        width = max(len(p) for p in prompts_token_ids)
        rows = num_prompts
        compiled = self.generation == "compiled"
        cache = dict(cache_implementation="static") if self.generation != "dynamic" else {}
        if compiled:
            # Few distinct shapes, so the compiled step and its CUDA graphs are reused across batches:
            # the width in steps of GENERATE_WIDTH_STEP, the rows a power of two (the last, smaller
            # batch of a run is filled up with copies of its first prompt, whose answers are dropped).
            width = -(-width // GENERATE_WIDTH_STEP) * GENERATE_WIDTH_STEP
            rows = 1 << max(0, num_prompts - 1).bit_length()
        prompts = list(prompts_token_ids) + [prompts_token_ids[0]] * (rows - num_prompts)
        input_ids_BL = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        mask_BL = torch.zeros_like(input_ids_BL)
        for b, ids in enumerate(prompts):
            input_ids_BL[b, width - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
            mask_BL[b, width - len(ids):] = 1
        torch.manual_seed(seed)
        # top_k=0 switches off the generation config's default top-k: only temperature and top_p apply.
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 \
            else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        out_BL = self.generation_model().generate(
            input_ids=input_ids_BL.to(self.device), attention_mask=mask_BL.to(self.device),
            max_new_tokens=max_new_tokens, eos_token_id=stops or None, pad_token_id=self.pad_token_id,
            disable_compile=not compiled, **cache, **sampling,
        )
        completions = []
        for row in out_BL[:num_prompts, width:].tolist():
            cut = next((j for j, t in enumerate(row) if t in stops), len(row))
            completions.append(row[:cut])
        return completions

    def close(self) -> None:
        self.model = self._generation_model = None


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)

