"""``peagle eval RUN_DIR|EXPORT_DIR --target DIR``: acceptance offline, in our own loop and in vLLM."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import typer

from peagle.cli import app
from peagle.cli.config_file import ConfigOption


def _resolve_source(source: Path, out: Path, num_depths: int | None, target: str | None) -> tuple[Path, Path | None]:
    """(export dir, run dir): an export is used as is; a run or checkpoint is exported into OUT/export."""
    from peagle.model.speculators_format import is_export_dir
    from peagle.stages.export.run import ExportConfig, run_export

    if is_export_dir(source):
        ckpt = (json.loads((source / "config.json").read_text()).get("peagle") or {}).get("checkpoint")
        run_dir = Path(ckpt).parent.parent if ckpt and Path(ckpt).parent.parent.is_dir() else None
        return source, run_dir
    run_dir = source if (source / "checkpoints").is_dir() else source.parent.parent
    export_dir = run_export(ExportConfig(source=str(source), out=str(out / "export"), verifier_name=target,
                                         speculative_tokens=num_depths))
    return export_dir, run_dir


@app.command("eval")
def eval_command(
    source: Path = typer.Argument(..., help="Training run directory, checkpoint directory, or export directory "
                                  "(a run or checkpoint is first exported into OUT/export, so every mode measures "
                                  "exactly what vLLM serves)."),
    target: Optional[str] = typer.Option(None, "--target", help="Target model directory (HF layout). Default: the "
                                         "verifier named in the export, if it is a local directory."),
    store: Optional[str] = typer.Option(None, "--store", help="Store for offline chains and prompts. Default: the "
                                        "run's --eval-store, else the held-out samples of its first training store."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="Prompts file: JSONL lines with `messages`, "
                                          "`prompt` or `prompt_token_ids`, or a .txt file of user messages. "
                                          "Default: the store's samples up to their first assistant reply."),
    num_depths: Optional[int] = typer.Option(None, "--num-depths", help="K: draft tokens per step (all modes). "
                                             "Default: the export's speculative_tokens."),
    mode: Optional[str] = typer.Option(None, "--mode", help="Comma list of offline,online,vllm. Default: every "
                                       "mode that can run here (offline needs a store, vllm needs vLLM)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Report directory (report.json + PNG plots). "
                                       "Default: RUN_DIR/eval, or EXPORT_DIR-eval."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy (outputs must equal plain decoding); "
                                      "> 0: sampling with the standard rejection rule."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens generated per prompt."),
    max_prompts: int = typer.Option(8, "--max-prompts", help="Prompts decoded (own loop and vLLM)."),
    max_samples: int = typer.Option(64, "--max-samples", help="Store samples evaluated offline."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (prompt i uses seed + i)."),
    target_dtype: str = typer.Option("float32", "--target-dtype", help="dtype of target and draft in the own loop "
                                     "(float32, bfloat16 or float64); vLLM runs bfloat16 for bfloat16, else float32."),
    device: str = typer.Option("auto", "--device", help="Device of the own loop: auto (cuda if available), cpu, cuda."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Always generate --max-new-tokens tokens."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bars."),
    config: Optional[str] = ConfigOption,
) -> None:
    """Measure acceptance length: teacher-forced chains on held-out shards (offline), speculative decoding
    with our own loop and the HF target (online: real acceptance, tokens per target forward, speedup over
    plain decoding), and the exported draft in vLLM with parallel drafting (its own metrics)."""
    from peagle.schemas.errors import UserError
    from peagle.stages.eval.run import EvalConfig, run_eval

    if not source.exists():
        raise UserError(f"{source} does not exist")
    if out is None:
        out = source / "eval" if (source / "checkpoints").is_dir() else source.with_name(source.name + "-eval")
    modes = tuple(m.strip() for m in mode.split(",") if m.strip()) if mode else None
    export_dir, run_dir = _resolve_source(source, out, num_depths, target)
    report = run_eval(EvalConfig(
        export_dir=str(export_dir), out=str(out), target=target, run_dir=str(run_dir) if run_dir else None,
        store=store, prompts=prompts, num_depths=num_depths, modes=modes, temperature=temperature,
        max_new_tokens=max_new_tokens, max_prompts=max_prompts, max_samples=max_samples, seed=seed,
        target_dtype=target_dtype, device=device, ignore_eos=ignore_eos, progress=not quiet))
    typer.echo(summary_table(report))
    typer.echo(f"report: {out / 'report.json'}  plots: {', '.join(str(out / p) for p in (report.get('plots') or {}).values())}")


def _fmt(x, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def summary_table(report: dict) -> str:
    """A few lines a person reads first: AL and per-depth acceptance per mode, speedup, output checks."""
    lines = [f"{'mode':<10} {'AL':>6}  per-depth acceptance"]
    for mode in ("offline", "online", "vllm"):
        section = report.get(mode)
        if not section:
            continue
        per_depth = " ".join(_fmt(v, 2) for v in section.get("per_depth_acceptance") or [])
        lines.append(f"{mode:<10} {_fmt(section.get('acceptance_length')):>6}  {per_depth}")
    online = report.get("online") or {}
    if online.get("speedup") is not None:
        lines.append(f"own loop: {_fmt(online.get('tokens_per_target_forward'), 2)} tokens/target forward, "
                     f"speedup {_fmt(online.get('speedup'), 2)}x over plain decoding, non-repetitive prompts AL "
                     f"{_fmt((online.get('non_repetitive') or {}).get('acceptance_length'))}")
    for mode, key in (("online", "greedy_output_matches_plain"), ("vllm", "greedy_output_matches_target_only")):
        value = (report.get(mode) or {}).get(key)
        if value is not None:
            lines.append(f"{mode}: greedy output equals the target's own: {value}")
    gap = (report.get("comparison") or {}).get("online_vs_vllm_relative_difference")
    if gap is not None:
        lines.append(f"own loop vs vLLM acceptance length: {100 * gap:.1f}% apart")
    return "\n".join(lines)
