"""`peagle store info` (what a store holds, how much of its plan is committed) and `peagle store verify`
(are its files intact, is every planned shard committed)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from peagle.pipeline.atomic import canonical_json
from peagle.pipeline.plan import Completeness, format_ranges, plural, store_completeness, usability_problem
from peagle.pipeline.store import check_shards, list_commits, manifest_dict, read_settings
from peagle.pipeline.shard_tensors import raw_bytes_per_token
from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.stages.store.finish_command import finish_commands, restart_commands


@dataclass(frozen=True, kw_only=True)
class StoreInfo:
    root: Path
    settings: S.StoreSettings
    num_shards: int
    num_records: int
    num_samples: int
    num_tokens: int
    num_truncated: int
    skipped: dict[str, int]
    total_bytes: int
    backends: tuple[str, ...]
    stats: list[S.ShardStats]  # of the shards whose commit records have statistics

    @property
    def health(self) -> str:
        """What the commit statistics say (``peagle store check`` reads the rows themselves)."""
        if not self.stats:
            return "no commit statistics (shards written before them): run `peagle store check`"
        zero, bad = sum(s.zero_rows for s in self.stats), sum(s.non_finite_rows for s in self.stats)
        positions = sum(s.topk.agree_positions for s in self.stats)
        agree = sum(s.topk.agree_count for s in self.stats) / positions if positions else 0.0
        return (f"{zero:,} all-zero and {bad:,} non-finite rows by the commit statistics of {len(self.stats)} of "
                f"{self.num_shards} shards; stored top-1 = next supervised token for {agree:.1%}")
    token_counts: dict[str, int]  # "supervised.<kind>" / "unsupervised.<role>", summed over shards
    num_supervised_turns: int
    num_rendered_per_turn: int
    num_shards_without_counts: int  # committed by a peagle that did not count token kinds
    completeness: Completeness  # the plan (input registrations) against the commit records
    problem: str | None = None  # why no reader can use it (``usability_problem``), with the command to run

    @property
    def bytes_per_token(self) -> float:
        """Actual bytes per token of the committed files (Parquet + safetensors)."""
        return self.total_bytes / self.num_tokens if self.num_tokens else 0.0

    @property
    def raw_bytes_per_token(self) -> int:
        """The tensors' raw bytes per token (``shard_tensors.raw_bytes_per_token``)."""
        return raw_bytes_per_token(self.settings)


def _open_root(root: str | Path) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"store {root} does not exist")
    return root


def store_info(root: str | Path) -> StoreInfo:
    """Summary of the committed shards (uncommitted files are invisible, as to every reader)."""
    root = _open_root(root)
    settings = read_settings(root)
    records = list_commits(root)
    skipped: Counter = Counter()
    counts: Counter = Counter()
    for r in records:
        skipped.update(r.skipped)
        counts.update(r.token_counts)
    return StoreInfo(
        root=root, settings=settings, num_shards=len(records), num_records=sum(r.num_records for r in records),
        num_samples=sum(r.num_samples for r in records), num_tokens=sum(r.num_tokens for r in records),
        num_truncated=sum(r.num_truncated for r in records), skipped=dict(sorted(skipped.items())),
        total_bytes=sum(r.parquet_bytes + r.safetensors_bytes for r in records),
        backends=_backends(records),
        stats=[r.stats for r in records if r.stats is not None],
        token_counts=dict(counts), num_supervised_turns=sum(r.num_supervised_turns for r in records),
        num_rendered_per_turn=sum(r.num_rendered_per_turn for r in records),
        num_shards_without_counts=sum(1 for r in records if r.num_tokens and not r.token_counts),
        completeness=(completeness := store_completeness(root, (r.index for r in records))),
        problem=usability_problem(root, records, restart_commands(completeness, settings, _backends(records))),
    )


def _backends(records: list[S.ShardRecord]) -> tuple[str, ...]:
    return tuple(sorted({r.backend for r in records if r.backend}))


def format_info(info: StoreInfo) -> str:
    s, t = info.settings, info.settings.target
    ratio = info.bytes_per_token / info.raw_bytes_per_token if info.num_tokens else 0.0
    lines = [
        f"store        {info.root}",
        f"schema       version {s.schema_version}",
        f"target       {t.path} ({t.architecture}, {t.num_hidden_layers} layers, hidden {t.hidden_size}, "
        f"vocab {t.vocab_size}, {t.dtype}, content {t.content_hash[:12]})",
        f"settings     aux_layer_ids {list(s.aux_layer_ids)} ({s.hidden_dtype}), topk {s.topk} ({s.logprob_dtype}), "
        f"max_seq_len {s.max_seq_len}, loss_on {s.loss_on}"
        + ("" if s.supervise_reasoning else ", reasoning not supervised"),
        f"mask token   {S.describe_mask_token(s.mask_token_id, s.mask_token, s.mask_token_source)}",
        f"tokenizer    {s.tokenizer_fingerprint[:12]}, chat template {s.chat_template_hash[:12]}",
        f"shards       {_shards_line(info)}" + (f" (backend {', '.join(info.backends)})" if info.backends else ""),
        *_missing_lines(info),
        *([f"UNUSABLE     {info.problem}"] if info.problem else []),
        f"records      {info.num_records:,} read, {_record_skips(info.skipped):,} skipped",
        f"samples      {info.num_samples:,} ({info.num_truncated:,} truncated to max_seq_len)",
        f"tokens       {info.num_tokens:,}",
        f"bytes/token  {info.bytes_per_token:,.1f} on disk vs {info.raw_bytes_per_token:,} raw tensor bytes "
        f"({ratio:.4f}x); {info.total_bytes:,} bytes in all",
    ]
    lines.append(f"rows         {info.health}")
    lines += format_token_counts(info)
    if info.skipped:
        lines.append("skipped      " + ", ".join(f"{k} {v}" for k, v in info.skipped.items()))
    return "\n".join(lines)


def _shards_line(info: StoreInfo) -> str:
    c = info.completeness
    if not c.recorded and not info.num_shards:
        return "0 committed, no plan recorded"
    if not c.recorded:
        return f"{info.num_shards} committed, no plan recorded (a store from before peagle recorded one)"
    return f"{c.num_committed} of {len(c.planned)} committed" + ("" if c.complete else ": INCOMPLETE")


def _missing_lines(info: StoreInfo) -> list[str]:
    """Which shards are missing (and whose records they hold), and the command that extracts them."""
    c = info.completeness
    if c.complete:
        return []
    by_input: dict[str, list[int]] = {}
    for shard in c.missing:
        by_input.setdefault(c.registration_of(shard).name, []).append(shard)
    where = "; ".join(f"{plural(len(shards), 'shard')} {format_ranges(shards)} of {name}"
                      for name, shards in by_input.items())
    lines = [f"missing      {where} ({c.missing_records():,} of {c.planned_records():,} planned records)",
             "finish with  (one worker extracts every missing shard; re-running it after a kill goes on)"]
    return lines + [f"             {command}" for command in finish_commands(c, info.settings, info.backends)]


def _record_skips(skipped: dict[str, int]) -> int:
    """Skipped records; the counts also hold samples dropped from kept records (``S.SAMPLE_DROPS``: a
    per-turn sample cut to no loss, a sample with non-finite target outputs), which are not records."""
    return sum(n for reason, n in skipped.items() if reason not in S.SAMPLE_DROPS)


def format_token_counts(info: StoreInfo) -> list[str]:
    """Supervised tokens by kind, unsupervised by role: a wrong loss mask shows here at a glance
    (e.g. ``outside_assistant`` above 0, or no ``end_of_turn`` per supervised turn)."""
    counts = info.token_counts
    supervised = {k.split(".", 1)[1]: v for k, v in counts.items() if k.startswith(S.SUPERVISED + ".")}
    unsupervised = {k.split(".", 1)[1]: v for k, v in counts.items() if k.startswith(S.UNSUPERVISED + ".")}
    if not counts:
        return ["supervised   not counted by kind (store written by an older peagle)"] if info.num_tokens else []
    total = sum(supervised.values())
    kinds = [*S.SUPERVISED_KINDS, *sorted(set(supervised) - set(S.SUPERVISED_KINDS))]
    lines = [f"supervised   {total:,} tokens ({total / max(info.num_tokens, 1):.1%}) in {info.num_supervised_turns:,} "
             "assistant turns: " + ", ".join(f"{k} {supervised.get(k, 0):,}" for k in kinds),
             "unsupervised " + ", ".join(f"{k} {v:,}" for k, v in sorted(unsupervised.items(), key=lambda kv: -kv[1]))]
    notes = []
    if info.num_rendered_per_turn:
        notes.append(f"{info.num_rendered_per_turn:,} records rendered turn by turn (their template rewrites history)")
    if info.num_shards_without_counts:
        notes.append(f"{info.num_shards_without_counts} shards written by an older peagle are not counted here")
    return lines + [f"             {n}" for n in notes]


def manifest_problem(root: Path, settings: S.StoreSettings, records: list[S.ShardRecord]) -> str | None:
    """Whether manifest.json is what the commit records derive, or an older derivation of them.

    A writer killed between a commit record and the manifest rebuild leaves the manifest one
    derivation behind: that is a legal crash state (readers use the commit records; the next run
    rebuilds it). Anything else -- a hand edit, a truncation, a shard listed with no commit record --
    is damage.
    """
    path = root / S.MANIFEST_FILE
    if not path.exists():  # killed before the first rebuild: as legal as a stale one
        return None
    try:
        listed = {shard["index"] for shard in json.loads(path.read_bytes())["shards"]}
    except (ValueError, KeyError, TypeError):
        listed = None
    if listed is not None and listed <= {r.index for r in records}:
        older = [r for r in records if r.index in listed]
        if path.read_bytes() == canonical_json(manifest_dict(settings, older)):
            return None
    return (f"{S.MANIFEST_FILE} differs from the commit records it is derived from (re-run the extract "
            "command to rebuild it; readers use the commit records)")


def verify_store(root: str | Path) -> tuple[int, list[str]]:
    """(number of committed shards, problems): every committed file's size and sha256 against its
    commit record, and every planned shard committed. An empty problem list means the store is
    intact and complete."""
    root = _open_root(root)
    settings = read_settings(root)
    records = list_commits(root)
    problems = check_shards(root, records, verify=True)
    if manifest_problem(root, settings, records):
        problems.append(manifest_problem(root, settings, records))
    completeness = store_completeness(root, (r.index for r in records))
    if not completeness.complete:
        problems.append(f"incomplete: {completeness.describe()}; `peagle store info --store {root}` prints the "
                        "command that finishes it")
    unusable = usability_problem(root, records, restart_commands(completeness, settings, _backends(records)))
    if unusable is not None:
        problems.append(unusable)
    return len(records), problems
