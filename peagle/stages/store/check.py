"""`peagle store check --store STORE`: does the store hold what a target computes? The content check that
``store verify`` (checksums) is not.

Inference engines have shipped bugs that dump all-zero, NaN or stale hidden states for some requests
(chunked prefill, prefix caching, tensor parallelism); checksums made after the fact cover them as
well as good rows, validation loss looks fine, and the served draft accepts almost nothing. This
module reads every committed row once and judges, per problem:

* **all-zero aux rows** and **non-finite rows** (aux or top-k);
* **norm outliers**: rows whose log L2 norm is more than ``norm_sigmas`` standard deviations from
  their layer's mean over the store (each sample's first row left out of the distribution and of
  the judgement: the attention sink's massive activations are legitimately huge);
* **implausible top-k mass**: ``Σ exp(logprobs)`` above 1 + tolerance, or below half of k/V (any k
  of V probabilities hold at least k/V);
* **misaligned samples**: the share of a sample's next tokens that equal the stored top-1 of the row
  before them far below the store's median, *and* the share found anywhere in that row's top-k far
  below its median (rows shifted, or taken from another sample, agree by chance only). Top-1 alone
  is not enough: text the target sampled at a temperature (``--regenerate``) can wander where its
  top-1 rarely agrees, yet each sampled token still lies in the stored top-k; misplaced rows miss
  both. The shifts ±1 are tried to say which;
* **duplicated aux rows**: a row equal, bit for bit, to the row of another position whose prefix
  differs (stale state). Equal prefixes give equal states legitimately (a shared system prompt), as
  does a leading run of one repeated token (every position attends to identical values);
* **commit statistics that disagree with the rows** they were committed with;
* **no supervised token at all**: a store extracted from input the extractor could not use (every
  record skipped, or no assistant text) holds nothing a draft can be trained on.

``check_target`` (``--target``) recomputes samples with the target itself. The report is one
``CheckReport`` (``check_report``): a table per problem with counts and the worst samples, and one
explanation line per failed problem; ``--json`` prints it whole.

Shape letters: n rows of a sample, A aux layers, H hidden size.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from peagle.pipeline.raw_reader import iter_raw_shards
from peagle.pipeline.shard_stats import SampleRows, mass_bounds, sample_rows, shard_stats
from peagle.pipeline.store import Store, open_store
from peagle.schemas import store as S
from peagle.schemas.check_config import CheckConfig
from peagle.stages.store.check_report import NUM_WORST, CheckReport, Finding, Worst

MIN_JUDGED_MEDIAN = 0.2  # below this median top-1 agreement, misalignment cannot be told from the data
TOPK_HIT_RATIO = 0.5  # ... and a misaligned sample's top-k hit share is below this fraction of the median's


# --------------------------------------------------------------------------------------------------
# One pass over the rows


@dataclass
class _SampleScan:
    shard: int
    sample_id: str
    rows: SampleRows
    agree_shifted: tuple[float, float]  # share of supervised tokens equal to the top-1 of the row two before
    #                                      (rows one position early), of their own row (one position late)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: uint64 -> well-spread uint64 (numpy wraps uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def row_hashes(states_nAH: np.ndarray) -> np.ndarray:
    """A 64-bit hash of every (row, layer) state's float32 bits ``[n, A]``: equal rows, equal hashes."""
    n, num_aux, hidden = states_nAH.shape
    words = np.ascontiguousarray(states_nAH, dtype=np.float32).view(np.uint32).astype(np.uint64)
    weights = _mix(np.arange(1, hidden + 1, dtype=np.uint64)) | np.uint64(1)
    with np.errstate(over="ignore"):
        return _mix((words * weights).sum(axis=-1, dtype=np.uint64))


def prefix_keys(input_ids: np.ndarray) -> np.ndarray:
    """A 64-bit key of every prefix x_0 … x_i: equal prefixes (hence legitimately equal states), equal keys.
    Positions inside a leading run of one repeated token share one key (their states are equal)."""
    ids = np.asarray(input_ids, dtype=np.uint64)
    n = ids.size
    with np.errstate(over="ignore"):
        keys = _mix(np.cumsum(_mix(ids + np.uint64(1)) * (_mix(np.arange(n, dtype=np.uint64) + np.uint64(7)) | 1),
                              dtype=np.uint64) ^ np.arange(n, dtype=np.uint64))
    if n:
        run = int(np.argmax(ids != ids[0])) if (ids != ids[0]).any() else n
        keys[:run] = _mix(ids[:1] + np.uint64(0x5151))[0]
    return keys


def scan_store(store: Store, *, progress: bool | None = None) -> tuple[list[_SampleScan], dict[str, np.ndarray],
                                                                       list[tuple[int, S.ShardStats]]]:
    """Read every committed row once: per-sample row facts, per-layer duplicate keys, and each shard's
    statistics as computed from its rows. Memory: about 30 bytes per token and aux layer that stay
    (an 8B store of 150 GB, ~6M tokens with 3 aux layers: ~0.6 GB), plus one sample's rows at a time."""
    import sys

    from tqdm import tqdm

    scans: list[_SampleScan] = []
    keys: dict[str, list[np.ndarray]] = {"hash": [], "prefix": [], "sample": [], "layer": [], "valid": []}
    computed = []
    bar = tqdm(total=store.num_tokens, unit="tok", unit_scale=True, desc="check", file=sys.stderr,
               disable=None if progress is None else not progress)
    for shard in iter_raw_shards(store):
        shard_rows = []
        for sample in shard.samples():
            n, ids, mask = sample.num_tokens, sample.input_ids_n.numpy(), sample.loss_mask_n.numpy()
            rows = sample_rows(sample)
            # Agreement as if the rows were one position off: top-1 of row i against x_{i+2} (early), x_i (late).
            top1 = sample.topk_ids_nk[:, 0].numpy()
            early = (top1[:-2] == ids[2:])[mask[2:]].mean() if mask[2:].any() else 0.0
            late = (top1[1:-1] == ids[1:-1])[mask[1:-1]].mean() if mask[1:-1].any() else 0.0
            scans.append(_SampleScan(shard.index, sample.sample_id, rows, (float(early), float(late))))
            shard_rows.append(rows)
            hashes_nA = row_hashes(sample.aux_nAH.float().numpy())
            valid_nA = ~rows.zero_nA & ~rows.non_finite_nA
            keys["hash"].append(hashes_nA.reshape(-1))
            keys["prefix"].append(np.repeat(prefix_keys(ids), hashes_nA.shape[1]))
            keys["sample"].append(np.full(hashes_nA.size, len(scans) - 1, np.int32))
            keys["layer"].append(np.tile(np.arange(hashes_nA.shape[1], dtype=np.int8), n))
            keys["valid"].append(valid_nA.reshape(-1))
            bar.update(n)
        computed.append((shard.index, shard_stats(shard_rows, store.settings)))
    bar.close()
    joined = {k: np.concatenate(v) if v else np.zeros(0) for k, v in keys.items()}
    return scans, joined, computed


# --------------------------------------------------------------------------------------------------
# Judging


def _worst(scans: list[_SampleScan], values: np.ndarray, *, detail: Callable[[int], str] | None = None,
           largest: bool = True) -> list[Worst]:
    """The NUM_WORST samples with the largest (or smallest) positive-count ``values``."""
    idx = np.nonzero(values > 0)[0] if largest else np.arange(values.size)
    idx = idx[np.argsort(-values[idx] if largest else values[idx], kind="stable")][:NUM_WORST]
    return [Worst(scans[i].shard, scans[i].sample_id, float(values[i]), detail(i) if detail else "") for i in idx]


def _per_sample(scans: list[_SampleScan], fn: Callable[[SampleRows], Any]) -> np.ndarray:
    return np.array([fn(s.rows) for s in scans], dtype=np.float64) if scans else np.zeros(0)


def judge_rows(store: Store, scans: list[_SampleScan], config: CheckConfig) -> list[Finding]:
    """Zero rows, non-finite rows, norm outliers and top-k mass."""
    layer_ids = store.settings.aux_layer_ids

    def layers_of(mask_name: str) -> Callable[[int], str]:
        def detail(i: int) -> str:
            per_layer = getattr(scans[i].rows, mask_name).sum(axis=0)
            return ", ".join(f"layer {layer_ids[a]}: {int(c)}" for a, c in enumerate(per_layer) if c)
        return detail

    zero = _per_sample(scans, lambda r: r.zero_nA.sum())
    non_finite = _per_sample(scans, lambda r: r.non_finite_nA.sum() + r.topk_non_finite_n.sum())
    findings = [
        Finding(key="zero_rows", title="all-zero aux rows", unit="rows", count=int(zero.sum()),
                allowed=config.max_zero_rows, worst=_worst(scans, zero, detail=layers_of("zero_nA")),
                explanation=f"{int(zero.sum())} aux rows ({int((zero > 0).sum())} of {len(scans)} samples) are all "
                            "zero: the extractor stored states the engine never wrote"),
        Finding(key="non_finite_rows", title="non-finite rows (aux, top-k)", unit="rows", count=int(non_finite.sum()),
                allowed=config.max_non_finite_rows, worst=_worst(scans, non_finite),
                explanation=f"{int(non_finite.sum())} rows ({int((non_finite > 0).sum())} of {len(scans)} samples) "
                            "hold NaN or inf"),
    ]

    # Norm outliers, against each layer's own distribution of log-norms over the store.
    num_aux = len(layer_ids)
    usable = [s.rows.norm_rows_nA() for s in scans]
    logs = [np.log(np.where(u, s.rows.norm_nA, 1.0).astype(np.float64)) for s, u in zip(scans, usable)]
    all_usable = np.concatenate(usable) if scans else np.zeros((0, num_aux), bool)
    all_logs = np.concatenate(logs) if scans else np.zeros((0, num_aux))
    counts = np.maximum(all_usable.sum(0), 1)
    mean_A = np.where(all_usable, all_logs, 0).sum(0) / counts
    std_A = np.sqrt(np.where(all_usable, (all_logs - mean_A) ** 2, 0).sum(0) / counts)
    z = [np.where(u, np.abs(lg - mean_A) / np.maximum(std_A, 1e-12), 0.0) for lg, u in zip(logs, usable)]
    is_out = [zz > config.norm_sigmas for zz in z]
    outliers = np.array([o.sum() for o in is_out], dtype=np.float64)
    per_layer = np.sum([o.sum(0) for o in is_out], axis=0) if scans else np.zeros(num_aux)
    allowed = int(config.max_outlier_fraction * int(counts.min()))
    worst_layer = int(np.argmax(per_layer / counts))
    findings.append(Finding(
        key="norm_outliers", title=f"aux rows with outlier norms (> {config.norm_sigmas:g} sd)", unit="rows",
        count=int(per_layer.max()) if num_aux else 0, allowed=allowed,
        worst=_worst(scans, outliers, detail=lambda i: f"{int(outliers[i])} rows, up to {z[i].max():.1f} sd"),
        explanation=f"layer {layer_ids[worst_layer]} has {int(per_layer[worst_layer])} rows whose norm is more than "
                    f"{config.norm_sigmas:g} sd from the layer's mean (exp {mean_A[worst_layer]:.3g} ± "
                    f"{std_A[worst_layer]:.3g} in log-norm): garbage or foreign states"))

    low, high = mass_bounds(store.settings)
    mass_bad = _per_sample(scans, lambda r: ((r.mass_n > high) | (r.mass_n < low))[~r.topk_non_finite_n].sum())
    findings.append(Finding(
        key="topk_mass", title=f"top-k rows with mass > {high:g} or < {low:.2g}", unit="rows",
        count=int(mass_bad.sum()), allowed=config.max_mass_rows,
        worst=_worst(scans, mass_bad, detail=lambda i: f"{int(mass_bad[i])} rows, mass "
                     f"{scans[i].rows.mass_n.min():.3g}..{scans[i].rows.mass_n.max():.3g}"),
        explanation=f"{int(mass_bad.sum())} top-k rows hold a probability mass no log-softmax over "
                    f"{store.settings.target.vocab_size} tokens gives"))
    return findings


def judge_alignment(scans: list[_SampleScan], config: CheckConfig) -> Finding:
    """Samples whose supervised tokens match the stored top-1 far less often than the store's median."""
    positions = _per_sample(scans, lambda r: r.supervised_n1.sum())
    share = _per_sample(scans, lambda r: r.agree_n1[r.supervised_n1].mean() if r.supervised_n1.any() else 0.0)
    hits = _per_sample(scans, lambda r: r.in_topk_n1[r.supervised_n1].mean() if r.supervised_n1.any() else 0.0)
    judged = positions >= config.min_agreement_positions
    median = float(np.median(share[judged])) if judged.any() else 0.0
    median_hits = float(np.median(hits[judged])) if judged.any() else 0.0
    finding = Finding(key="misaligned", title="misaligned samples (top-1 vs next token)", unit="samples",
                      count=0, allowed=config.max_misaligned_samples)
    if median < MIN_JUDGED_MEDIAN:
        finding.judged = False
        finding.explanation = (f"not judged: the store's median top-1 agreement is {median:.2f} (< "
                               f"{MIN_JUDGED_MEDIAN}); the data is not text the target writes itself")
        return finding
    bad = judged & (share < config.agreement_ratio * median) & (hits < TOPK_HIT_RATIO * median_hits)

    def detail(i: int) -> str:
        early, late = scans[i].agree_shifted
        shift = ("; rows look one position early (row i holds position i+1)" if early >= 0.5 * median else
                 "; rows look one position late (row i holds position i-1)" if late >= 0.5 * median else "")
        return f"agreement {share[i]:.2f} vs median {median:.2f}, in top-k {hits[i]:.2f} vs {median_hits:.2f}{shift}"

    finding.count = int(bad.sum())
    finding.worst = _worst(scans, np.where(bad, 1.0 - share, 0.0), detail=detail)
    first = finding.worst[0] if finding.worst else None
    finding.explanation = (f"{finding.count} of {int(judged.sum())} judged samples agree with the target's top-1 far "
                           f"less than the store's median {median:.2f}: their rows do not belong to their tokens"
                           + (f" (e.g. {first})" if first else ""))
    return finding


def judge_duplicates(scans: list[_SampleScan], keys: dict[str, np.ndarray], config: CheckConfig) -> Finding:
    """Rows equal to a row of another prefix: states copied from elsewhere (stale state).

    Equal rows form a group; within it, the prefix most rows share is where the state belongs, and the
    rows of other prefixes are the copies (with a tie, every row of the tied prefixes is counted).
    """
    valid = keys["valid"].astype(bool)
    h, p, smp, lay = (keys[k][valid] for k in ("hash", "prefix", "sample", "layer"))
    if not h.size:
        return Finding(key="duplicate_rows", title="aux rows duplicated across positions", unit="rows", count=0,
                       allowed=config.max_duplicate_rows)
    group_key = h ^ _mix(lay.astype(np.uint64) + np.uint64(99))  # equal rows of the same layer
    order = np.lexsort((p, group_key))
    g, pp, ss = group_key[order], p[order], smp[order]
    new_group = np.r_[True, g[1:] != g[:-1]]
    new_segment = new_group | np.r_[True, pp[1:] != pp[:-1]]  # one segment per (group, prefix)
    group_of, segment_of = np.cumsum(new_group) - 1, np.cumsum(new_segment) - 1
    segment_size = np.bincount(segment_of)
    segment_group = group_of[new_segment]
    largest = np.zeros(group_of[-1] + 1, np.int64)
    np.maximum.at(largest, segment_group, segment_size)
    num_largest = np.bincount(segment_group, weights=segment_size == largest[segment_group])
    num_segments = np.bincount(segment_group)
    copied_segment = (num_segments[segment_group] > 1) & ((segment_size < largest[segment_group])
                                                          | (num_largest[segment_group] > 1))
    dup = copied_segment[segment_of]
    first_of = np.nonzero(new_group)[0]
    start, end = first_of[group_of], np.r_[first_of[1:], g.size][group_of] - 1
    partner = np.where(pp == pp[start], ss[end], ss[start])  # a row of the group with another prefix
    per_sample = np.bincount(ss[dup], minlength=len(scans)).astype(np.float64)
    partner_of = {int(a): int(b) for a, b in zip(ss[dup], partner[dup])}
    count = int(dup.sum())
    worst = _worst(scans, per_sample, detail=lambda i: f"{int(per_sample[i])} rows equal rows of "
                   f"{scans[partner_of[i]].sample_id} at other positions")
    return Finding(key="duplicate_rows", title="aux rows duplicated across positions", unit="rows", count=count,
                   allowed=config.max_duplicate_rows, worst=worst,
                   explanation=f"{count} aux rows ({int((per_sample > 0).sum())} of {len(scans)} samples) are bit-equal "
                               "to rows of other positions with other prefixes: stale or copied states"
                               + (f" (e.g. {worst[0]})" if worst else ""))


def judge_commit_stats(store: Store, computed: list[tuple[int, S.ShardStats]]) -> Finding:
    """Shards whose commit record's statistics are not those of their rows (records without statistics,
    written before they existed, are computed here and pass)."""
    differ = []
    for index, stats in computed:
        committed = store.shard(index).stats
        if committed is not None and not _same_stats(committed, stats):
            differ.append(index)
    return Finding(key="commit_stats", title="commit statistics that disagree with the rows", unit="shards",
                   count=len(differ), allowed=0,
                   worst=[Worst(i, "*", 1.0, "statistics differ") for i in differ[:NUM_WORST]],
                   explanation=f"{len(differ)} shards' commit records describe other rows than they hold "
                               f"(first: shard {S.shard_stem(differ[0]) if differ else '-'}): the rows were "
                               "changed after commit, with checksums re-made")


def judge_supervised(scans: list[_SampleScan]) -> Finding:
    """A store without one supervised token fails: there is nothing to train on."""
    supervised = int(sum(s.rows.supervised_n1.sum() for s in scans))
    return Finding(key="no_supervised_tokens", title="store without a supervised token", unit="stores",
                   count=int(supervised == 0), allowed=0,
                   explanation=f"the store holds no supervised token in its {len(scans)} samples: nothing to train "
                               "on (`peagle store info` shows what extraction skipped, and why)")


def _same_stats(a: S.ShardStats, b: S.ShardStats) -> bool:
    da, db = asdict(a), asdict(b)

    def close(x: Any, y: Any) -> bool:
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(close(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(close(u, v) for u, v in zip(x, y))
        if isinstance(x, float) or isinstance(y, float):
            return abs(x - y) <= 1e-4 * max(abs(x), abs(y), 1e-12)
        return x == y

    return close(da, db)


def check_store(config: CheckConfig, *, progress: bool | None = None,
                echo: Callable[[str], None] = print) -> CheckReport:
    """Read every row of the store once and judge it (module docstring); with ``config.target`` also
    recompute samples with the target (``check_target``)."""
    started = time.perf_counter()
    store = open_store(config.store)
    scans, keys, computed = scan_store(store, progress=progress)
    report = CheckReport(store=store.root, hidden_dtype=store.settings.hidden_dtype, num_shards=len(store.shards),
                         num_samples=store.num_samples, num_tokens=store.num_tokens)
    report.findings = [*judge_rows(store, scans, config), judge_alignment(scans, config),
                       judge_duplicates(scans, keys, config),
                       judge_commit_stats(store, computed), judge_supervised(scans)]
    if config.target is not None:
        from peagle.stages.store.check_target import check_target

        finding, summary = check_target(store, config, echo=echo)
        report.findings.append(finding)
        report.target = summary
    report.seconds = time.perf_counter() - started
    return report


__all__ = ["check_store", "prefix_keys", "row_hashes", "scan_store"]
