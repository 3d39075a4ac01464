"""`peagle eval`: offline chains, own speculative loop and vLLM on one export, into one report.

A run or checkpoint is first exported (:func:`resolve_source`), so every mode measures the weights
vLLM serves. Modes:

* ``offline`` -- teacher-forced chains on held-out store samples (:mod:`.offline`);
* ``online`` -- our own speculative-decoding loop with the HF target (:mod:`.online`);
* ``vllm`` -- the export in vLLM with parallel drafting (:mod:`.vllm_eval`);
* ``server`` -- a running ``vllm serve EXPORT_DIR`` at ``--server URL`` (:mod:`.server`), judged
  against ``online`` / ``vllm``.

All use the same K (``num_depths``) and, online, vLLM and server, the same prompts and stop tokens.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import peagle
from peagle.model.checkpoint_export import check_served_k, export_checkpoint
from peagle.model.speculators_config import recorded_schedule
from peagle.model.export_provenance import recorded_path
from peagle.model.speculators_format import (PROVENANCE_KEY, ExportedDraft, load_export, looks_like_export,
                                              read_export_config)
from peagle.model.target.directory import CONFIG_FILE, check_store_matches_target, load_tokenizer, open_target
from peagle.pipeline.store import Store, open_store
from peagle.pipeline.store_reader import iter_training_samples
from peagle.pipeline.tracking.tracker import eval_plan, log_eval_report
from peagle.schemas.checkpoint import CHECKPOINTS_DIR
from peagle.schemas.errors import UserError
from peagle.schemas.eval_config import EvalConfig
from peagle.schemas.speculative_schedule import schedule_text
from peagle.schemas.secrets import redact
from peagle.schemas.train_config import parse_store_spec
from peagle.stages.eval import offline, online, prompts as prompt_sources, report as reporting, server as serving, speed
from peagle.stages.eval.vllm_eval import run_vllm, vllm_available

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class EvalSource:
    """What ``EvalConfig.source`` resolves to: the export every mode measures, the run it came from
    (metrics, stores; None if unknown) and the report directory."""

    export_dir: Path
    run_dir: Path | None
    out: Path


def resolve_source(config: EvalConfig) -> EvalSource:
    """An export is used as is; a run or checkpoint is first exported into OUT/export (with the
    ``--num-depths`` and ``--target`` of this evaluation as K and verifier).

    Raises:
        UserError: when ``source`` does not exist or holds no usable checkpoint.
    """
    source = Path(config.source)
    if not source.exists():
        raise UserError(f"{source} does not exist")
    is_run = (source / CHECKPOINTS_DIR).is_dir()
    out = Path(config.out) if config.out else (source / "eval" if is_run else source.with_name(source.name + "-eval"))
    if looks_like_export(source):  # a damaged config.json is named as such (read_export_config)
        provenance = read_export_config(source).get(PROVENANCE_KEY) or {}
        ckpt = provenance.get("checkpoint")
        run_dir = recorded_path(source, provenance, ckpt).parent.parent if isinstance(ckpt, str) and ckpt else None
        return EvalSource(source, run_dir if run_dir is not None and run_dir.is_dir() else None, out)
    export_dir = export_checkpoint(source, out / "export", verifier_name=config.target,
                                   speculative_tokens=config.num_depths, k_flag="--num-depths")
    return EvalSource(export_dir, source if is_run else source.parent.parent, out)


def _warn(message: str) -> None:
    print(f"peagle: warning: {message}", file=sys.stderr)


def resolve_store(config: EvalConfig, exported: ExportedDraft) -> tuple[Store | None, float | None]:
    """(store, held-out fraction or None) for offline chains and store prompts (``EvalConfig.store``).

    A store the run trained on counts only its held-out samples (the loader's sample_id hash rule). A
    store the run recorded that is not on this machine (a draft that travelled, a store since deleted)
    is none: what needs no store still runs; ``--store`` named and missing is an error.
    """
    run = exported.run_config
    train_stores = [str(exported.recorded_path(parse_store_spec(s).path).resolve()) for s in run.get("store") or []]
    recorded_eval = str(exported.recorded_path(run["eval_store"])) if run.get("eval_store") else None
    path = config.store or recorded_eval or (train_stores[0] if train_stores else None)
    if path is None:
        return None, None
    if config.store is None and not Path(path).exists():  # where the run trained, not where the draft is now
        if config.mode is None or "offline" in config.mode or not config.prompts:
            _warn(f"the run's store {path} is not on this machine: no offline chains, no prompts from it "
                  "(pass --store to name where it is)")
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


def resolve_modes(config: EvalConfig, has_store: bool) -> list[str]:
    """``--mode``, checked, or the default (EvalConfig.mode): with ``--server`` no in-process vllm,
    since the server holds the accelerator."""
    if config.mode is not None:
        if "offline" in config.mode and not has_store:
            raise UserError("--mode offline needs a store: pass --store (the run records none, or one not on this "
                            "machine)")
        if "vllm" in config.mode and not vllm_available():
            raise UserError("--mode vllm needs vLLM importable here (scripts/install_vllm.sh); drop it from --mode")
        return list(config.mode)
    modes = ["offline"] if has_store else []
    modes.append("online")
    if config.server:
        modes.append("server")
    elif vllm_available():
        modes.append("vllm")
    else:
        _warn("vLLM is not importable here: skipping --mode vllm")
    return modes


def run_eval(config: EvalConfig, *, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the selected modes, write the report and plots, echo the summary table; returns the report."""
    if config.prompts:  # before any export or model load: an empty file is a mistake, not 0 prompts
        prompt_sources.prompt_lines(config.prompts)
    where = resolve_source(config)
    tracking = eval_plan(config, run_dir=where.run_dir, out=where.out)  # before any mode: one line if it cannot
    exported = load_export(where.export_dir)
    draft = exported.draft
    K = config.num_depths or exported.speculative_tokens
    check_served_k(K, exported.num_depths_trained, draft.config.method, flag="--num-depths")
    schedule = recorded_schedule(exported.config_json)
    if schedule is not None and K != exported.speculative_tokens:  # its Ks were chosen for the export's K
        _warn(f"the export's speculative schedule ({schedule_text(schedule)}) is for K = "
              f"{exported.speculative_tokens}: served at --num-depths {K} without it")
        schedule = None
    target_dir = config.target or exported.verifier
    store, heldout = resolve_store(config, exported)
    modes = resolve_modes(config, store is not None)
    needs_target = bool({"online", "vllm", "server"} & set(modes))
    if needs_target:
        if not (target_dir and (Path(target_dir) / CONFIG_FILE).is_file()):
            raise UserError(f"online/vLLM/server modes need the target model (its tokenizer, chat template and stop "
                            f"tokens at least): pass --target DIR (export names {target_dir!r})")
        if store is not None:  # its samples become prompts: they must be the target's own tokens
            check_store_matches_target(store.settings, open_target(target_dir), store=store.root)
    probe = None
    if "server" in modes:  # before any slow mode: a wrong server is one line at once
        probe = serving.probe_server(config.server, export_dir=where.export_dir,
                                     verifiers=[exported.verifier, target_dir], num_depths=K,
                                     timeout=config.server_timeout)
    torch.manual_seed(config.seed)
    sections: dict[str, dict[str, Any]] = {}
    greedy_outputs: dict[str, list[list[int]] | None] = {}  # the target's own, for the server's check

    if "offline" in modes:
        samples = iter_training_samples(store, heldout_fraction=heldout, max_samples=config.max_samples)
        result = offline.evaluate_offline(draft, samples, K, progress=not config.quiet)
        if result.num_samples == 0:
            _warn(f"offline: no sample to evaluate in {store.root}"
                  + (f" (it is a training store of the run, so only its held-out {heldout:g} of samples count, "
                     "and there are none; pass another --store)" if heldout else ""))
        elif result.histogram.num_steps == 0:
            _warn("offline: no sample had a fully supervised chain of K positions")
        sections["offline"] = {**result.to_dict(), "store": str(store.root), "heldout_fraction": heldout}

    prompt_ids, prompt_source, stops = [], None, []
    costs = None
    if needs_target:
        tokenizer = load_tokenizer(target_dir)
        prompt_ids, prompt_source = _prompts(config, tokenizer, store, heldout)
        stops = [] if config.ignore_eos else prompt_sources.stop_token_ids(tokenizer, target_dir)

    if "online" in modes:
        device = ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
        if device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda was asked for, but torch sees no CUDA device")
        dtype = TORCH_DTYPES[config.target_dtype]
        target = online.HFTarget.load(target_dir, draft.config.aux_layer_ids, dtype=dtype, device=device,
                                      compiled=config.online_compile)
        drafter = online.proposer_drafter(draft.to(device=device, dtype=dtype), target.vocab_size)
        result = online.evaluate_online(target, drafter, prompt_ids, num_depths=K, max_new_tokens=config.max_new_tokens,
                                        temperature=config.temperature, seed=config.seed, stop_ids=set(stops),
                                        progress=not config.quiet)
        sections["online"] = {**result.to_dict(), "speed": online_speed(result), "prompt_source": prompt_source}
        if all(r.plain is not None for r in result.prompts):
            greedy_outputs["target"] = [r.plain.tokens for r in result.prompts]
        if prompt_ids:  # what each part of a step costs here: the K recommendation reads it
            costs = speed.measure_step_costs(target, drafter, prompt_ids[0], max_depths=K,
                                             batch_sizes=speed.SCHEDULE_BATCH_SIZES)
        del target

    if "vllm" in modes:
        # vLLM has no float64; a bfloat16 own loop is compared with a bfloat16 engine.
        vllm_dtype = "bfloat16" if config.target_dtype == "bfloat16" else "float32"
        result = run_vllm(exported.path, prompt_ids, num_speculative_tokens=K, max_new_tokens=config.max_new_tokens,
                          temperature=config.temperature, seed=config.seed, stop_ids=stops, dtype=vllm_dtype,
                          ignore_eos=config.ignore_eos, target_only=config.temperature <= 0,
                          enforce_eager=not config.vllm_compile, concurrency=config.concurrency or (),
                          speculative_schedule=schedule,
                          target=None if _same_path(target_dir, exported.verifier) else target_dir)
        sections["vllm"] = {**result.to_dict(), "prompt_source": prompt_source}
        greedy_outputs["vllm_target_only"] = result.target_only_outputs

    if "server" in modes:
        section, outputs = serving.measure_server(probe, prompt_ids, max_new_tokens=config.max_new_tokens,
                                                  stop_ids=stops, ignore_eos=config.ignore_eos)
        sections["server"] = {
            **section, **serving.greedy_matches(outputs, greedy_outputs),
            "drafting": serving.judge_drafting(section, {m: sections.get(m) for m in ("online", "vllm")},
                                               parallel=draft.config.method != "eagle3"),
            "prompt_source": prompt_source}

    speed_report = None
    if costs is not None:
        speed_report = {"step_costs": costs.to_dict(),
                        "k_recommendation": speed.k_recommendation(sections, costs, served_k=K,
                                                                   parallel=draft.config.method != "eagle3")}

    meta = {
        "peagle_version": peagle.__version__,
        "export_dir": str(where.export_dir.resolve()),
        "target": str(target_dir),
        "run_dir": str(where.run_dir) if where.run_dir else None,
        "num_depths": K,
        "num_depths_trained": exported.num_depths_trained,
        "modes": modes,
        "settings": {k: v for k, v in asdict(config).items() if k not in ("source", "quiet")},
    }
    # redacted: the settings may hold a tracking URI or a server URL with credentials (schemas/secrets.py)
    report = redact(reporting.build_report(sections=sections, meta=meta, speed=speed_report))
    reporting.write_report(where.out, report, metrics=reporting.read_metrics(where.run_dir))
    log_eval_report(tracking, report, run_dir=where.run_dir, out=where.out, config=meta["settings"])
    echo(reporting.summary_table(report))
    echo(f"report: {where.out / reporting.REPORT_FILE}  plots: "
         + ", ".join(str(where.out / p) for p in (report.get("plots") or {}).values()))
    return report


def online_speed(result: online.OnlineResult) -> dict[str, Any]:
    """Our loop decodes one request at a time: its tokens/s with and without the draft are the
    concurrency-1 figures; it has no concurrency-N figure (vLLM's section does)."""
    plains = [r.plain for r in result.prompts if r.plain is not None]
    return {"concurrency_1": speed.speed_figures(
                concurrency=1, spec_tokens=sum(len(r.spec.tokens) for r in result.prompts),
                spec_seconds=sum(r.spec.seconds for r in result.prompts),
                plain_tokens=sum(len(p.tokens) for p in plains) if plains else None,
                plain_seconds=sum(p.seconds for p in plains) if plains else None),
            "concurrency_n": None}


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
