"""The evaluation report: one JSON file and a few PNG plots a person can read at a glance.

``REPORT_DIR/report.json`` holds every mode's numbers (see :func:`build_report`; :func:`summary_table`
is what `peagle eval` prints of it); the plots are

* ``per_depth_acceptance.png`` -- P(draft d accepted) for d = 1..K, per mode (offline chains, own
  loop, vLLM, a live server), with the conditional acceptance of the offline chains;
* ``acceptance_length.png`` -- AL(k) for k = 1..K, per mode;
* ``speed.png`` -- generated tokens/s with the draft and without it, per mode, one request at a time
  (the headline: speculative decoding is a latency tool) and, in vLLM, every prompt at once;
* ``training_curves.png`` -- loss, per-depth agreement and acceptance-length estimate against the
  step, from ``RUN_DIR/metrics.jsonl`` (skipped when there is none). Each line says what it is: the
  trainer's estimate on its own training batches reads high (the draft is scored on text it trains
  on) and is not a measurement; an eval line is the teacher-forced estimate on ``--eval-store`` (or the
  ``--heldout-fraction`` split); the dotted levels are the acceptance lengths this report measured, so a
  reader never takes the training estimate for the result.

matplotlib runs on its Agg backend (no display); the JSON is written atomically.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from peagle.pipeline.atomic import atomic_write_json
from peagle.pipeline.contained import inside
from peagle.schemas.run_files import METRICS_FILE

REPORT_FILE = "report.json"
MODES = ("offline", "online", "vllm", "server")
MODE_LABELS = {"offline": "offline (teacher-forced chains)", "online": "own loop", "vllm": "vLLM",
               "server": "live vLLM server"}

COMPARED_PAIRS = (("online", "vllm"), ("server", "online"), ("server", "vllm"))
"""The (A, B) modes whose AL gap the report gives, as ``A_vs_B_relative_difference``."""


def _finite(x: Any) -> Any:
    """JSON has no NaN: non-finite floats become null, recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def compare_modes(sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """AL and per-depth acceptance side by side, and the relative AL gaps |a - b| / b of own loop vs
    vLLM, server vs own loop and server vs vLLM (``A_vs_B_relative_difference``)."""
    out: dict[str, Any] = {mode: {"acceptance_length": s.get("acceptance_length"),
                                  "per_depth_acceptance": s.get("per_depth_acceptance")}
                           for mode, s in sections.items() if s}
    for a_mode, b_mode in COMPARED_PAIRS:
        a, b = ((sections.get(m) or {}).get("acceptance_length") for m in (a_mode, b_mode))
        if a and b:
            out[f"{a_mode}_vs_{b_mode}_relative_difference"] = abs(a - b) / b
    return out


def build_report(*, sections: dict[str, dict[str, Any]], meta: dict[str, Any],
                 speed: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"meta", "offline", "online", "vllm", "server", "comparison", "speed"}`` (absent modes are
    null; ``speed``: the step costs and the K recommendation of :mod:`.speed`, when our loop ran)."""
    report = {"meta": meta, **{m: sections.get(m) for m in MODES}, "comparison": compare_modes(sections),
              "speed": speed}
    return _finite(report)


def read_metrics(run_dir: str | os.PathLike | None) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl`` (unparseable lines, e.g. a torn last line, skipped)."""
    if run_dir is None:
        return []
    path = inside(run_dir, METRICS_FILE, tree="run")  # a received run's link out of itself is refused
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def write_report(report_dir: str | os.PathLike, report: dict[str, Any], *,
                 metrics: list[dict[str, Any]] | None = None) -> dict[str, Path]:
    """Write the plots and report.json (listing them under ``plots``) into ``report_dir``; sets
    ``report["plots"]`` and returns {name: path} of everything written."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    plots = {"per_depth_acceptance": plot_per_depth(report), "acceptance_length": plot_acceptance_length(report),
             "speed": plot_speed(report)}
    if metrics:
        plots["training_curves"] = plot_training_curves(metrics, measured=measured_acceptance(report))
    for name, figure in plots.items():
        if figure is None:
            continue
        path = report_dir / f"{name}.png"
        tmp = report_dir / f".{name}.png.tmp-{os.getpid()}"
        figure.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
        os.replace(tmp, path)
        _close(figure)
        written[name] = path
    report["plots"] = {name: path.name for name, path in written.items()}
    atomic_write_json(report_dir / REPORT_FILE, report)
    written["report"] = report_dir / REPORT_FILE
    return written


def _figure(width: float = 6.4, height: float = 4.0):
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def _close(figure) -> None:
    figure.clear()


def plot_per_depth(report: dict[str, Any]):
    figure = _figure()
    ax = figure.add_subplot()
    drawn = False
    for mode in MODES:
        section = report.get(mode) or {}
        values = section.get("per_depth_acceptance")
        if not values:
            continue
        depths = list(range(1, len(values) + 1))
        ax.plot(depths, [v if v is not None else math.nan for v in values], marker="o", label=MODE_LABELS[mode])
        drawn = True
        if mode == "offline" and section.get("conditional_acceptance"):
            cond = [v if v is not None else math.nan for v in section["conditional_acceptance"]]
            ax.plot(depths, cond, linestyle="--", marker=".", label="offline, conditional on depth d-1")
    if not drawn:
        return None
    ax.set_xticks(range(1, max(len((report.get(m) or {}).get("per_depth_acceptance") or []) for m in MODES) + 1))
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("P(draft d accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Per-depth acceptance")
    ax.grid(alpha=0.3)
    ax.legend()
    return figure


def plot_acceptance_length(report: dict[str, Any]):
    figure = _figure()
    ax = figure.add_subplot()
    drawn = False
    for mode in MODES:
        values = (report.get(mode) or {}).get("acceptance_length_by_k")
        if not values:
            continue
        ks = list(range(1, len(values) + 1))
        ax.plot(ks, [v if v is not None else math.nan for v in values], marker="o", label=MODE_LABELS[mode])
        drawn = True
    if not drawn:
        return None
    ax.set_xticks(range(1, max(len((report.get(m) or {}).get("acceptance_length_by_k") or []) for m in MODES) + 1))
    ax.set_xlabel("speculative tokens K")
    ax.set_ylabel("acceptance length AL(K)")
    ax.set_title("Acceptance length vs K (tokens per target forward)")
    ax.grid(alpha=0.3)
    ax.legend()
    return figure


def plot_speed(report: dict[str, Any]):
    """Tokens/s with the draft and without it, per mode and concurrency (one request at a time, then
    every prompt at once), with the ratio over each pair."""
    bars = []
    for mode in ("online", "vllm"):
        speed = (report.get(mode) or {}).get("speed") or {}
        for key in concurrency_keys(speed):
            figures = speed.get(key) or {}
            if figures.get("spec_tokens_per_second") is not None and figures.get("plain_tokens_per_second") is not None:
                bars.append((f"{MODE_LABELS[mode]}\nconcurrency {figures['concurrency']}", figures))
    if not bars:
        return None
    figure = _figure(width=max(4.0, 2.2 * len(bars)))
    ax = figure.add_subplot()
    xs = range(len(bars))
    ax.bar([x - 0.2 for x in xs], [f["plain_tokens_per_second"] for _, f in bars], width=0.4, label="target alone")
    ax.bar([x + 0.2 for x in xs], [f["spec_tokens_per_second"] for _, f in bars], width=0.4, label="with the draft")
    for x, (_, f) in zip(xs, bars):
        top = max(f["plain_tokens_per_second"], f["spec_tokens_per_second"])
        ax.text(x, top * 1.02, f"{f['speedup']:.2f}x" if f.get("speedup") else "-", ha="center", fontsize=9)
    ax.set_xticks(list(xs), [label for label, _ in bars], fontsize=8)
    ax.set_ylabel("generated tokens/s")
    ax.set_title("Decoding speed with and without the draft (wall clock)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return figure


def _series(metrics: list[dict[str, Any]], kind: str, key: str, index: int | None = None) -> tuple[list, list]:
    """(steps, values) of ``key`` (element ``index`` of a list value) in the records of ``kind``."""
    xs, ys = [], []
    for record in metrics:
        if record.get("kind", "train") != kind or "step" not in record:
            continue
        value = record.get(key)
        if index is not None:
            value = value[index] if isinstance(value, list) and index < len(value) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            xs.append(record["step"])
            ys.append(float(value))
    return xs, ys


CURVE_LABELS = {
    "train": "training batches: agreement estimate, not a measurement",
    "eval": "eval store / held-out split: teacher-forced estimate",
}
"""What each kind of metrics.jsonl line's AL estimate is, as the training-curves plot labels it."""
LOSS_LABELS = {"train": "training batches", "eval": "eval store / held-out split"}

MEASURED_LABELS = {"offline": "offline chains on eval's --store", "online": "own loop, eval prompts",
                   "vllm": "vLLM, eval prompts", "server": "live vLLM server, eval prompts"}


def measured_acceptance(report: dict[str, Any]) -> dict[str, float]:
    """{mode: acceptance length} of every mode this report measured (for the training-curves plot)."""
    out = {}
    for mode in MODES:
        al = (report.get(mode) or {}).get("acceptance_length")
        if isinstance(al, (int, float)) and not isinstance(al, bool) and math.isfinite(al):
            out[mode] = float(al)
    return out


def plot_training_curves(metrics: list[dict[str, Any]], *, measured: dict[str, float] | None = None):
    """Loss, per-depth top-1 agreement and the AL estimate against the step, train (solid) and eval
    (dashed), from the trainer's metrics.jsonl records (``kind``, ``step``, ``loss``,
    ``depth_agreement`` [K], ``acceptance_length_estimate``); ``measured`` ({mode: AL} of
    :func:`measured_acceptance`) draws what eval measured as dotted levels beside the estimates.

    The labels say what each line is (:data:`CURVE_LABELS`): the training-batch estimate is scored on
    the batches the draft trains on, so it reads high (a small draft memorises its batches) and must
    never be read as the result."""
    num_depths = max((len(r.get("depth_agreement") or []) for r in metrics), default=0)
    figure = _figure(width=15.0, height=4.3)
    axes = [figure.add_subplot(1, 3, i) for i in (1, 2, 3)]
    drawn = False
    for kind, style in (("train", "-"), ("eval", "--")):
        for ax, key, label in ((axes[0], "loss", LOSS_LABELS[kind]),
                               (axes[2], "acceptance_length_estimate", CURVE_LABELS[kind])):
            xs, ys = _series(metrics, kind, key)
            if xs:
                ax.plot(xs, ys, style, marker="." if len(xs) < 30 else None, label=label)
                drawn = True
        for d in range(num_depths):
            xs, ys = _series(metrics, kind, "depth_agreement", d)
            if xs:
                axes[1].plot(xs, ys, style, color=f"C{d % 10}", label=f"{kind}, depth {d}")
    if not drawn:
        return None
    for i, (mode, al) in enumerate((measured or {}).items()):
        axes[2].axhline(al, linestyle=":", linewidth=2.0, color=f"C{(i + 2) % 10}",
                        label=f"measured by peagle eval ({MEASURED_LABELS.get(mode, mode)}): {al:.2f}")
    titles = ("loss (forward KL)", "top-1 agreement per depth\n(solid: training batches, dashed: eval)",
              "acceptance length\nestimates (lines) against measured (dotted)")
    for ax, title in zip(axes, titles):
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # the AL estimates rise to the top right: keep it clear
            ax.legend(fontsize=7, loc="lower right" if ax is axes[2] else "best")
    figure.text(0.5, -0.04, "Training-batch figures are scored on text the draft trains on: they read high and are "
                "not a measurement. The result is the measured acceptance length (report.json).",
                ha="center", fontsize=8)
    return figure


def _fmt(x: Any, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def concurrency_keys(speed: dict[str, Any]) -> list[str]:
    """A mode's speed keys in the order they are read: one request at a time (the headline), the waves
    of ``--concurrency`` (``concurrency_C``, ascending), then every prompt at once (``concurrency_n``)."""
    waves = sorted((k for k in speed if k.startswith("concurrency_") and k.removeprefix("concurrency_").isdigit()
                    and k != "concurrency_1"), key=lambda k: int(k.removeprefix("concurrency_")))
    return ["concurrency_1", *waves, "concurrency_n"]


def speed_lines(speed: dict[str, Any]) -> list[str]:
    """Tokens/s with and without the draft, one line per concurrency measured (1 first: the headline),
    with the draft tokens per draft where a batch-size schedule changed K."""
    lines = []
    for key in concurrency_keys(speed):
        figures = speed.get(key)
        if not figures or figures.get("spec_tokens_per_second") is None:
            continue
        n = figures.get("concurrency")
        what = ("one request at a time" if key == "concurrency_1" else f"{n} requests at once" if key == "concurrency_n"
                else f"waves of {n} at once")
        per_draft = figures.get("draft_tokens_per_draft")
        lines.append(f"{what}: {_fmt(figures['spec_tokens_per_second'], 1)} "
                     f"tokens/s with the draft, {_fmt(figures.get('plain_tokens_per_second'), 1)} without: "
                     f"{_fmt(figures.get('speedup'), 2)}x"
                     + (f" ({_fmt(per_draft, 2)} draft tokens per draft)" if per_draft is not None else ""))
    return lines


def recommended_speedup(recommendation: dict[str, Any]) -> float | None:
    """The recommended K's predicted speedup: at the level the served K measured when it measured one
    (``calibrated_speedup``), else our loop's own prediction."""
    return recommendation.get("calibrated_speedup") or recommendation.get("predicted_speedup")


def summary_table(report: dict[str, Any]) -> str:
    """A few lines a person reads first: AL and per-depth acceptance per mode, speedup, output checks."""
    lines = [f"{'mode':<10} {'AL':>6}  per-depth acceptance"]
    for mode in MODES:
        section = report.get(mode)
        if not section:
            continue
        per_depth = " ".join(_fmt(v, 2) for v in section.get("per_depth_acceptance") or [])
        lines.append(f"{mode:<10} {_fmt(section.get('acceptance_length')):>6}  {per_depth}")
    for mode, name in (("online", "own loop"), ("vllm", "vLLM")):
        section = report.get(mode) or {}
        if section.get("tokens_per_target_forward") is not None:
            engine = section.get("settings") or {}
            how = ("" if "enforce_eager" not in engine
                   else " (eager engines)" if engine["enforce_eager"] else " (compiled engines)")
            lines.append(f"{name}{how}: {_fmt(section.get('tokens_per_target_forward'), 2)} tokens/target forward"
                         + (f", non-repetitive prompts AL {_fmt(section['non_repetitive'].get('acceptance_length'))}"
                            if section.get("non_repetitive") else ""))
        lines += [f"  {line}" for line in speed_lines(section.get("speed") or {})]
    recommended = (report.get("speed") or {}).get("k_recommendation") or {}
    if recommended.get("best_k"):
        gain = recommended.get("predicted_gain_over_served_k")
        lines.append(f"K: {recommended['best_k']} predicted fastest here ({_fmt(recommended_speedup(recommended), 2)}x "
                     f"plain decoding; {_fmt(gain, 2)}x the served K = {recommended.get('served_k')}), from "
                     f"{recommended.get('acceptance_from')}'s per-depth acceptance and our loop's step costs; "
                     "break-even AL by K (a line through the timed steps): "
                     + " ".join(_fmt(r['break_even_acceptance_length'], 2) for r in recommended.get("by_k") or []))
    schedule = recommended.get("schedule") or {}
    if schedule.get("text"):
        sizes = "/".join(str(e["batch_size"]) for e in schedule["by_batch_size"])
        lines.append(f"K per batch size (predicted, {sizes} requests): peagle export --speculative-tokens "
                     f"{schedule['speculative_tokens']} --speculative-schedule {schedule['text']} (0: no drafting)")
    live = report.get("server") or {}
    if live:
        lines.append(f"server: {_fmt(live.get('tokens_per_target_forward'), 2)} tokens/target forward, "
                     f"{_fmt(live.get('spec_tokens_per_second'), 1)} generated tokens/s over HTTP, "
                     f"drafting {(live.get('drafting') or {}).get('verdict')}")
    for mode, key in (("online", "greedy_output_matches_plain"), ("vllm", "greedy_output_matches_target_only"),
                      ("server", "greedy_output_matches_target"), ("server", "greedy_output_matches_vllm_target_only")):
        value = (report.get(mode) or {}).get(key)
        if value is not None:
            section = report.get(mode) or {}
            matching = section.get("greedy_prompts_matching_target_only") if key.endswith("target_only") else None
            lines.append(f"{mode}: greedy output equals the target's own{' (vLLM)' if 'vllm' in key else ''}: {value}"
                         + (f" ({matching} of {section.get('num_prompts')} prompts; bf16 rounding, see docs/usage.md)"
                            if matching is not None and not value else ""))
    names = {"online": "own loop", "vllm": "vLLM", "server": "server"}
    for a, b in COMPARED_PAIRS:
        gap = (report.get("comparison") or {}).get(f"{a}_vs_{b}_relative_difference")
        if gap is not None:
            lines.append(f"{names[a]} vs {names[b]} acceptance length: {100 * gap:.1f}% apart")
    return "\n".join(lines)
