"""The seed tables of benchmarks/quality.py and benchmarks/peer_ab.py: per-variant (per-trainer
configuration) statistics over seeds, the comparisons the README quotes (Welch's t: a variant
against the baseline and its named reference; a speculators configuration against peagle), and the
tables printed at the end of a run."""

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
    print(f"{'variant':<10} {'AL vLLM':>15} {'AL own':>15} {'AL offline':>15}  per-depth (vLLM)   vs baseline (vLLM)")
    for name, entry in summary.items():
        vs = (entry.get("vs_baseline") or {}).get("al_vllm")
        verdict = "" if vs is None else f"{vs['diff']:+.3f} " + NOISE_WORD[vs["beyond_noise"]]
        ref = entry.get("vs_reference")
        if ref is not None:
            verdict += f"; vs {ref['variant']} {ref['al_vllm']['diff']:+.3f} " + NOISE_WORD[ref["al_vllm"]["beyond_noise"]]
        print(f"{name:<10} {_mean_se(entry['al_vllm']):>15} {_mean_se(entry['al_own']):>15} {_mean_se(entry['al_offline']):>15}  "
              + " ".join(f"{a:.2f}" for a in entry["per_depth"]) + f"   {verdict}")


def _mean_se(d: dict | None) -> str:
    if d is None:
        return "-"
    return f"{d['mean']:.3f}" + (f" ± {d['se']:.3f}" if d["se"] is not None else "")


def summarise_peers(records: list[dict]) -> dict:
    """Per configuration: mean/std/se of every AL over seeds, per-depth means, seconds, Welch vs peagle."""
    groups = describe_groups(records, "config", ("al_vllm", "al_own", "al_offline"))
    by_config = {name: recs for name, (recs, _) in groups.items()}
    out = {}
    for name, (recs, entry) in groups.items():
        entry["per_depth"] = [statistics.fmean(d) for d in zip(*(r["per_depth"] for r in recs))]
        entry["positions"] = statistics.fmean(r["positions"] for r in recs)
        entry["train_seconds"] = statistics.fmean(r["seconds"]["train"] for r in recs)
        entry["train_cpu_seconds"] = statistics.fmean(r["cpu_seconds"]["train"] for r in recs)
        entry["greedy_equal_everywhere"] = all(r["vllm_greedy_matches_target"] and r["greedy_output_matches_plain"]
                                               is not False for r in recs)
        if name != "peagle" and "peagle" in by_config:
            peagle = by_config["peagle"]
            entry["vs_peagle"] = {key: welch([r[key] for r in recs], [r[key] for r in peagle])
                                  for key in ("al_vllm", "al_own", "al_offline")
                                  if entry[key] is not None and all(r[key] is not None for r in peagle)}
        out[name] = entry
    return out


def print_peer_table(summary: dict) -> None:
    print(f"{'configuration':<21} {'n':>2} {'AL vLLM':>15} {'AL own':>15} {'AL offline':>15}  per-depth (vLLM)"
          f"          train s   vs peagle (vLLM)")
    for name, entry in summary.items():
        vs = (entry.get("vs_peagle") or {}).get("al_vllm")
        verdict = "" if vs is None else f"{vs['diff']:+.3f} " + NOISE_WORD[vs["beyond_noise"]]
        depths = " ".join(f"{a:.2f}" for a in entry["per_depth"])
        print(f"{name:<21} {entry['al_vllm']['n']:>2} {_mean_se(entry['al_vllm']):>15} {_mean_se(entry['al_own']):>15} "
              f"{_mean_se(entry['al_offline']):>15}  {depths:<25} {entry['train_seconds']:>7.0f}   {verdict}")
