"""What `peagle store check` reports: per problem (``Finding``) how many rows or samples show it, how many
are allowed, the worst samples, and the one line that explains it; tables for people, JSON for machines."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from peagle.schemas import store as S

NUM_WORST = 5


@dataclass(frozen=True)
class Worst:
    shard: int
    sample_id: str
    value: float  # how bad (a count, a z-score, an agreement)
    detail: str = ""

    def __str__(self) -> str:
        return f"{S.shard_stem(self.shard)}:{self.sample_id} ({self.detail or _num(self.value)})"


@dataclass(kw_only=True)
class Finding:
    """One problem: how many rows or samples show it, how many are allowed, the worst samples, and the
    one line that explains it when it fails."""

    key: str
    title: str
    unit: str  # "rows" | "samples"
    count: int
    allowed: int
    worst: list[Worst] = field(default_factory=list)
    explanation: str = ""
    judged: bool = True  # False: the store gives this check no signal (``explanation`` says why)

    @property
    def failed(self) -> bool:
        return self.judged and self.count > self.allowed


@dataclass(kw_only=True)
class CheckReport:
    store: Path
    hidden_dtype: str
    num_shards: int
    num_samples: int
    num_tokens: int
    seconds: float = 0.0
    findings: list[Finding] = field(default_factory=list)
    target: dict[str, Any] | None = None  # check_target's summary

    @property
    def failed(self) -> list[Finding]:
        return [f for f in self.findings if f.failed]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["store"] = str(self.store)
        d["ok"] = not self.failed
        for finding, out in zip(self.findings, d["findings"]):
            out["failed"] = finding.failed
        return d


def _num(x: float) -> str:
    return f"{x:,}" if float(x).is_integer() else f"{x:.3g}"


def format_report(report: CheckReport) -> str:
    """Tables a person reads at a glance, then one explanation line per failed check."""
    lines = [f"store check {report.store}: {report.num_shards} shards, {report.num_samples:,} samples, "
             f"{report.num_tokens:,} tokens, {report.hidden_dtype} hidden states ({report.seconds:.1f} s)",
             f"  {'check':<46} {'found':>9} {'allowed':>8}  worst samples (shard:sample_id)"]
    for f in report.findings:
        found = f"{f.count:,} {f.unit}" if f.judged else "-"
        worst = ", ".join(str(w) for w in f.worst[:3]) if f.worst else ("-" if f.judged else f.explanation)
        lines.append(f"  {f.title:<46} {found:>9} {f.allowed:>8,}  {worst}")
    if report.target and report.target.get("relative_error_per_layer"):
        t = report.target
        per_layer = ", ".join(f"layer {layer} {e['mean']:.3g} (max {e['max']:.3g})"
                              for layer, e in t["relative_error_per_layer"].items())
        lines.append(f"  --target {t['target']}: {len(t['samples'])} samples recomputed; aux relative error {per_layer}; "
                     f"top-1 agreement {t['top1_agreement']['mean']:.3f} (min {t['top1_agreement']['min']:.3f})")
    failed = report.failed
    if failed:
        lines.append(f"FAILED: {len(failed)} check(s)")
        lines += [f"  {f.key}: {f.explanation}" for f in failed]
    else:
        lines.append("store check passed: no problem above its threshold")
    return "\n".join(lines)


__all__ = ["CheckReport", "Finding", "NUM_WORST", "Worst", "format_report"]
