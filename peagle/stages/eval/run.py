"""`peagle eval`: offline chains, own speculative loop and vLLM on one export, into one report.

The CLI hands this stage an *export directory* (it exports a run first), so every mode measures the
weights vLLM serves. Modes:

* ``offline`` -- teacher-forced chains on held-out store samples (:mod:`.offline`);
* ``online`` -- our own speculative-decoding loop with the HF target (:mod:`.online`);
* ``vllm`` -- the export in vLLM with parallel drafting (:mod:`.vllm_eval`).

All use the same K (``num_depths``) and, online and vLLM, the same prompts and stop tokens.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import peagle
from peagle.model.speculators_format import ExportedDraft, load_export
from peagle.model.target import CONFIG_FILE, check_store_matches_target, open_target
from peagle.pipeline.store import Store, open_store
from peagle.pipeline.store_reader import iter_training_samples
from peagle.schemas.errors import UserError
from peagle.stages.eval import offline, online, prompts as prompt_sources, report as reporting
from peagle.stages.eval.vllm_eval import run_vllm, vllm_available

ALL_MODES = ("offline", "online", "vllm")
TARGET_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Settings of `peagle eval` (after the CLI resolved the source to an export)."""

    export_dir: str
    """The speculators 'peagle' directory to evaluate."""
    out: str
    """Report directory: report.json and the PNG plots."""
    target: str | None = None
    """Target model directory (HF layout). Default: the export's verifier, if it is a local directory."""
    run_dir: str | None = None
    """Training run directory, for metrics.jsonl (training curves) and the run's stores."""
    store: str | None = None
    """Store for offline chains (and prompts). Default: the run's eval store, else the held-out
    samples of its first training store."""
    prompts: str | None = None
    """Prompts file for online/vLLM decoding (JSONL or .txt). Default: store samples, else built-ins."""
    num_depths: int | None = None
    """K. Default: the export's speculative_tokens."""
    modes: tuple[str, ...] | None = None
    """Subset of offline, online, vllm. Default: each one that can run here."""
    temperature: float = 0.0
    """0: greedy (outputs must equal plain decoding); > 0: sampling with the standard rejection rule."""
    max_new_tokens: int = 64
    """Tokens generated per prompt (own loop and vLLM)."""
    max_prompts: int = 8
    """Prompts decoded (own loop and vLLM)."""
    max_samples: int = 64
    """Store samples evaluated offline."""
    seed: int = 0
    """Sampling seed (prompt i uses seed + i)."""
    target_dtype: str = "float32"
    """dtype of target and draft in the own loop; vLLM runs bfloat16 for bfloat16, else float32."""
    device: str = "auto"
    """Device of the own loop: auto (cuda if available), cpu or cuda."""
    ignore_eos: bool = False
    """Always generate max_new_tokens tokens (no stop tokens)."""
    progress: bool = True
    """Show progress bars."""

    def __post_init__(self) -> None:
        if self.modes is not None:
            unknown = sorted(set(self.modes) - set(ALL_MODES))
            if unknown or not self.modes:
                raise UserError(f"--mode takes a comma list of {','.join(ALL_MODES)}, got {','.join(self.modes)}")
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0, got {self.temperature}")
        for name in ("max_new_tokens", "max_prompts", "max_samples"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.num_depths is not None and self.num_depths < 1:
            raise UserError(f"--num-depths must be >= 1, got {self.num_depths}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UserError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.target_dtype not in TARGET_DTYPES:
            raise UserError(f"--target-dtype must be one of {'|'.join(TARGET_DTYPES)}, got {self.target_dtype!r}")


def _warn(message: str) -> None:
    print(f"peagle: warning: {message}", file=sys.stderr)


def resolve_store(config: EvalConfig, exported: ExportedDraft) -> tuple[Store | None, float | None]:
    """(store, held-out fraction or None) for offline chains and store prompts (``EvalConfig.store``).

    A store the run trained on counts only its held-out samples (the loader's sample_id hash rule).
    """
    run = exported.run_config
    train_stores = [str(Path(s.rsplit(":", 1)[0] if _has_weight(s) else s).resolve()) for s in run.get("store") or []]
    path = config.store or run.get("eval_store") or (train_stores[0] if train_stores else None)
    if path is None:
        return None, None
    store = open_store(path)
    settings = store.settings
    draft_config = exported.draft.config
    if list(settings.aux_layer_ids) != list(draft_config.aux_layer_ids) or \
            settings.target.hidden_size != draft_config.target_hidden_size:
        raise UserError(f"store {path} has aux layers {list(settings.aux_layer_ids)} / hidden size "
                        f"{settings.target.hidden_size}, the draft reads {list(draft_config.aux_layer_ids)} / "
                        f"{draft_config.target_hidden_size}")
    fraction = run.get("heldout_fraction") or 0.0
    heldout = (not run.get("eval_store") and fraction > 0 and str(Path(path).resolve()) in train_stores)
    return store, (fraction if heldout else None)


def _has_weight(spec: str) -> bool:
    head, sep, tail = spec.rpartition(":")
    try:
        return bool(sep and head) and float(tail) > 0
    except ValueError:
        return False


def resolve_modes(config: EvalConfig, has_store: bool) -> list[str]:
    if config.modes is not None:
        if "offline" in config.modes and not has_store:
            raise UserError("--mode offline needs a store: pass --store (the run records none)")
        if "vllm" in config.modes and not vllm_available():
            raise UserError("--mode vllm needs vLLM importable here (scripts/install_vllm.sh); drop it from --mode")
        return list(config.modes)
    modes = ["offline"] if has_store else []
    modes.append("online")
    if vllm_available():
        modes.append("vllm")
    else:
        _warn("vLLM is not importable here: skipping --mode vllm")
    return modes


def run_eval(config: EvalConfig) -> dict[str, Any]:
    """Run the selected modes, write the report and plots; returns the report dict."""
    exported = load_export(config.export_dir)
    draft = exported.draft
    K = config.num_depths or exported.speculative_tokens
    target_dir = config.target or exported.verifier
    store, heldout = resolve_store(config, exported)
    modes = resolve_modes(config, store is not None)
    needs_target = "online" in modes or "vllm" in modes
    if needs_target:
        if not (target_dir and (Path(target_dir) / CONFIG_FILE).is_file()):
            raise UserError(f"online/vLLM modes need the target model: pass --target DIR (export names {target_dir!r})")
        if store is not None:  # its samples become prompts: they must be the target's own tokens
            check_store_matches_target(store.settings, open_target(target_dir), store=store.root)
    torch.manual_seed(config.seed)
    sections: dict[str, dict[str, Any]] = {}

    if "offline" in modes:
        samples = iter_training_samples(store, heldout_fraction=heldout, max_samples=config.max_samples)
        result = offline.evaluate_offline(draft, samples, K, progress=config.progress)
        if result.num_samples == 0:
            _warn(f"offline: no sample to evaluate in {store.root}"
                  + (f" (it is a training store of the run, so only its held-out {heldout:g} of samples count, "
                     "and there are none; pass another --store)" if heldout else ""))
        elif result.histogram.num_steps == 0:
            _warn("offline: no sample had a fully supervised chain of K positions")
        sections["offline"] = {**result.to_dict(), "store": str(store.root), "heldout_fraction": heldout}

    prompt_ids, prompt_source, stops = [], None, []
    if needs_target:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        prompt_ids, prompt_source = _prompts(config, tokenizer, store, heldout)
        stops = [] if config.ignore_eos else prompt_sources.stop_token_ids(tokenizer, target_dir)

    if "online" in modes:
        device = ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
        if device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda was asked for, but torch sees no CUDA device")
        dtype = TARGET_DTYPES[config.target_dtype]
        target = online.HFTarget.load(target_dir, draft.config.aux_layer_ids, dtype=dtype, device=device)
        drafter = online.proposer_drafter(draft.to(device=device, dtype=dtype), target.vocab_size)
        result = online.evaluate_online(target, drafter, prompt_ids, num_depths=K, max_new_tokens=config.max_new_tokens,
                                        temperature=config.temperature, seed=config.seed, stop_ids=set(stops),
                                        progress=config.progress)
        sections["online"] = {**result.to_dict(), "prompt_source": prompt_source}
        del target

    if "vllm" in modes:
        # vLLM has no float64; a bfloat16 own loop is compared with a bfloat16 engine.
        vllm_dtype = "bfloat16" if config.target_dtype == "bfloat16" else "float32"
        result = run_vllm(exported.path, prompt_ids, num_speculative_tokens=K, max_new_tokens=config.max_new_tokens,
                          temperature=config.temperature, seed=config.seed, stop_ids=stops, dtype=vllm_dtype,
                          ignore_eos=config.ignore_eos, target_only=config.temperature <= 0,
                          target=None if _same_path(target_dir, exported.verifier) else target_dir)
        sections["vllm"] = {**result.to_dict(), "prompt_source": prompt_source}

    meta = {
        "peagle_version": peagle.__version__,
        "export_dir": str(Path(config.export_dir).resolve()),
        "target": str(target_dir),
        "run_dir": config.run_dir,
        "num_depths": K,
        "num_depths_trained": exported.num_depths_trained,
        "modes": modes,
        "settings": {k: v for k, v in asdict(config).items() if k not in ("export_dir", "progress")},
    }
    report = reporting.build_report(sections=sections, meta=meta)
    reporting.write_report(config.out, report, metrics=reporting.read_metrics(config.run_dir))
    return report


def _same_path(a: str | None, b: str | None) -> bool:
    return bool(a and b) and (a == b or Path(a).resolve() == Path(b).resolve())


def _prompts(config: EvalConfig, tokenizer, store: Store | None, heldout: float | None) -> tuple[list[list[int]], str]:
    if config.prompts:
        found = prompt_sources.prompts_from_file(config.prompts, tokenizer)[: config.max_prompts]
        return found, f"file {config.prompts}"
    if store is not None:
        samples = iter_training_samples(store, heldout_fraction=heldout)
        found = prompt_sources.prompts_from_samples(samples, config.max_prompts)
        if found:
            return found, f"store {store.root}" + (" (held-out samples)" if heldout else "")
    return prompt_sources.builtin_prompts(tokenizer, config.max_prompts), "built-in"
