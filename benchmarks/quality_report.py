"""The seed table of benchmarks/quality.py: per-variant statistics over seeds, the comparisons the
README quotes (each variant against the baseline and against its named reference, Welch's t), and
the table printed at the end of a run."""

from __future__ import annotations

import statistics

from quality_variants import REFERENCE

from peagle.testing.seed_statistics import describe_groups, welch


def versus(records: list[dict], other: list[dict]) -> dict:
    """Welch's test of one variant's records against another's, on AL in vLLM and teacher-forced."""
    return {key: welch([r[key] for r in records], [r[key] for r in other]) for key in ("al_vllm", "al_offline")}


def summarise(records: list[dict]) -> dict:
    """Per variant: mean/std/se of every AL over seeds, mean per-depth acceptance, Welch vs baseline."""
    groups = describe_groups(records, "variant", ("al_vllm", "al_own", "al_offline"))
    by_variant = {name: recs for name, (recs, _) in groups.items()}
    out = {}
    for name, (recs, entry) in groups.items():
        entry["method"] = recs[0].get("method", "peagle")  # records from before EAGLE-3 are P-EAGLE's
        entry["per_depth"] = [statistics.fmean(depths) for depths in zip(*(r["per_depth"] for r in recs))]
        entry["train_seconds"] = statistics.fmean(r["train_seconds"] for r in recs)
        cpu = [r["cpu_seconds"]["train"] for r in recs if "cpu_seconds" in r]
        entry["train_cpu_seconds"] = statistics.fmean(cpu) if cpu else None
        if name != "baseline" and "baseline" in by_variant:
            entry["vs_baseline"] = versus(recs, by_variant["baseline"])
        reference = REFERENCE.get(name)
        if reference in by_variant:
            entry["vs_reference"] = {"variant": reference, **versus(recs, by_variant[reference])}
        out[name] = entry
    return out


NOISE_WORD = {True: "(beyond noise)", False: "(noise)", None: "(n<2)"}


def print_table(summary: dict) -> None:
    def fmt(d: dict | None) -> str:
        if d is None:
            return "-"
        return f"{d['mean']:.3f}" + (f" ± {d['se']:.3f}" if d["se"] is not None else "")

    print(f"{'variant':<10} {'AL vLLM':>15} {'AL own':>15} {'AL offline':>15}  per-depth (vLLM)   vs baseline (vLLM)")
    for name, entry in summary.items():
        vs = (entry.get("vs_baseline") or {}).get("al_vllm")
        verdict = "" if vs is None else f"{vs['diff']:+.3f} " + NOISE_WORD[vs["beyond_noise"]]
        ref = entry.get("vs_reference")
        if ref is not None:
            verdict += f"; vs {ref['variant']} {ref['al_vllm']['diff']:+.3f} " + NOISE_WORD[ref["al_vllm"]["beyond_noise"]]
        print(f"{name:<10} {fmt(entry['al_vllm']):>15} {fmt(entry['al_own']):>15} {fmt(entry['al_offline']):>15}  "
              + " ".join(f"{a:.2f}" for a in entry["per_depth"]) + f"   {verdict}")
