"""`peagle store check --store STORE --target MODEL_DIR`: recompute random samples with the Hugging Face target
(the HF backend extract uses, ``peagle.model.target.hf_backend``) and compare them with what the store holds.

Per recomputed sample: the relative error ``||stored − recomputed|| / ||recomputed||`` of each aux
layer's rows, and the share of rows whose stored top-1 id is the recomputed one. A sample fails when
some layer is off by more than ``max_relative_error`` or the top-1 agreement is below
``min_top1_agreement``. The failure is explained in one line that says which: rows shifted by one
position (the stored rows match the recomputation one position over), rows of some samples that
belong elsewhere (stale state) while the others match, a target of another shape, or another
target (no sample matches; the line says whether the store's recorded content hash is this target's).

Shape letters: n rows of a sample, A aux layers, H hidden size, k top-k.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from peagle.model.target.directory import open_target
from peagle.pipeline.raw_reader import RawShard, open_raw_shard
from peagle.pipeline.store import Store
from peagle.schemas import store as S
from peagle.schemas.check_config import CheckConfig
from peagle.stages.store.check_report import Finding, Worst

TITLE = "samples unlike the target's own recomputation"


def relative_errors(stored_nAH: torch.Tensor, recomputed_nAH: torch.Tensor) -> np.ndarray:
    """``||stored − recomputed|| / ||recomputed||`` per aux layer ``[A]``, over the rows given."""
    s, r = stored_nAH.double(), recomputed_nAH.double()
    diff = torch.linalg.vector_norm(s - r, dim=(0, 2))
    return (diff / torch.linalg.vector_norm(r, dim=(0, 2)).clamp_min(1e-30)).numpy()


def pick_samples(store: Store, num: int, seed: int) -> list[tuple[int, int]]:
    """``num`` (shard index, row) pairs drawn without replacement by ``seed``, in store order."""
    pairs = [(r.index, row) for r in store.shards for row in range(r.num_samples)]
    chosen = np.random.default_rng(seed).choice(len(pairs), size=min(num, len(pairs)), replace=False)
    return [pairs[i] for i in sorted(chosen)]


def _shape_mismatch(settings: S.StoreSettings, config: Any) -> str | None:
    t = settings.target
    for name, held, want in (("hidden_size", t.hidden_size, config.hidden_size),
                             ("num_hidden_layers", t.num_hidden_layers, config.num_hidden_layers),
                             ("vocab_size", t.vocab_size, config.vocab_size)):
        if int(held) != int(want):
            return f"the store was extracted from another target: it has {name} {held}, --target has {want}"
    return None


def check_target(store: Store, config: CheckConfig, *,
                 echo: Callable[[str], None] = print) -> tuple[Finding, dict[str, Any]]:
    """Recompute ``config.samples`` samples with ``config.target`` and judge them (module docstring)."""
    from peagle.model.target.hf_backend import HFBackend

    settings = store.settings
    target = open_target(config.target)
    finding = Finding(key="target", title=TITLE, unit="samples", count=0, allowed=0)
    same_weights = not target.other_weights(settings.target)
    summary: dict[str, Any] = {"target": str(config.target), "same_content_hash": same_weights, "samples": []}
    mismatch = _shape_mismatch(settings, target.config)
    if mismatch:
        finding.count, finding.explanation = store.num_samples, mismatch
        return finding, summary

    picks = pick_samples(store, config.samples, config.seed)
    if not picks:
        return finding, summary  # an empty store: nothing to recompute
    echo(f"recomputing {len(picks)} samples with {config.target} ...")
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    backend = HFBackend(config.target, aux_layer_ids=settings.aux_layer_ids, topk=settings.topk,
                        dtype=settings.target.dtype, device=config.device, pad_token_id=pad)
    layer_ids = settings.aux_layer_ids
    results: list[dict[str, Any]] = []
    opened: dict[int, RawShard] = {}  # one shard mapped at a time
    try:
        for shard, row in picks:
            if shard not in opened:
                opened = {shard: open_raw_shard(store, shard)}
            sample = opened[shard].sample(row)
            n = sample.num_tokens
            stored_nAH = sample.aux_nAH.float()
            stored_top1 = sample.topk_ids_nk[:, 0]
            out = backend.run([sample.input_ids_n.tolist()])[0]
            recomputed_nAH = out.aux_TAH.float()
            results.append({
                "shard": shard, "sample_id": sample.sample_id, "num_tokens": n,
                "relative_error": relative_errors(stored_nAH, recomputed_nAH).tolist(),
                # stored row i = the target's row i+1 (rows one position early), or row i-1 (late)
                "relative_error_early": float(relative_errors(stored_nAH[:-1], recomputed_nAH[1:]).max()) if n > 1 else 0.0,
                "relative_error_late": float(relative_errors(stored_nAH[1:], recomputed_nAH[:-1]).max()) if n > 1 else 0.0,
                "top1_agreement": float((stored_top1 == out.topk_ids_TK[:, 0]).float().mean()),
            })
    finally:
        backend.close()
    summary["samples"] = results
    errors = np.array([r["relative_error"] for r in results])  # [samples, A]
    top1 = np.array([r["top1_agreement"] for r in results])
    summary["relative_error_per_layer"] = {str(layer): {"mean": float(errors[:, a].mean()), "max": float(errors[:, a].max())}
                                           for a, layer in enumerate(layer_ids)}
    summary["top1_agreement"] = {"mean": float(top1.mean()), "min": float(top1.min())}
    bad = (errors.max(axis=1) > config.max_relative_error) | (top1 < config.min_top1_agreement)
    finding.count = int(bad.sum())
    finding.worst = [Worst(r["shard"], r["sample_id"], max(r["relative_error"]),
                           f"relative error {max(r['relative_error']):.3g}, top-1 agreement {r['top1_agreement']:.2f}")
                     for r in sorted((r for r, b in zip(results, bad) if b), key=lambda r: -max(r["relative_error"]))]
    if not finding.count:
        return finding, summary
    failing = [r for r, b in zip(results, bad) if b]
    shifted = [r for r in failing if min(r["relative_error_early"], r["relative_error_late"]) <= config.max_relative_error]
    worst_layer = int(np.argmax(errors.max(axis=0)))
    if len(shifted) * 2 >= len(failing):
        r = shifted[0]
        early = r["relative_error_early"] <= r["relative_error_late"]
        finding.explanation = (
            f"{len(shifted)} of {len(results)} recomputed samples have their rows shifted by one position: stored row "
            f"i holds the target's state at position {'i+1' if early else 'i-1'} (relative error "
            f"{min(r['relative_error_early'], r['relative_error_late']):.3g} shifted vs {max(r['relative_error']):.3g} "
            f"in place; e.g. {S.shard_stem(r['shard'])}:{r['sample_id']})")
    elif len(failing) < len(results):
        r = failing[0]
        finding.explanation = (
            f"{len(failing)} of {len(results)} recomputed samples are not what --target computes for their tokens "
            f"(aux relative error up to {max(r['relative_error']):.3g}, top-1 agreement {r['top1_agreement']:.2f}; "
            f"no one-position shift explains it) while the others match: their rows are stale or belong to other "
            f"samples (e.g. {S.shard_stem(r['shard'])}:{r['sample_id']})")
    else:
        recorded = (f"its recorded target {settings.target.path} has content hash {settings.target.content_hash[:12]}, "
                    f"--target has {target.content_hash[:12]}" if not same_weights else
                    "although it records this target's content hash")
        finding.explanation = (
            f"none of {len(results)} recomputed samples matches --target {config.target} (aux relative error up to "
            f"{errors[:, worst_layer].max():.3g} on layer {layer_ids[worst_layer]}, top-1 agreement "
            f"{top1.min():.2f}..{top1.max():.2f}, no one-position shift explains it): the store was extracted from "
            f"another target ({recorded})")
    return finding, summary


__all__ = ["check_target", "pick_samples", "relative_errors"]
