"""The `peagle extract` driver: plan, then for each of this worker's missing shards, records ->
samples -> target forward in fixed batches -> write + commit (on the writer thread).

Re-running the same command finishes what is missing and never redoes what is committed (docs/reliability.md). With the hf backend the shards are byte-identical to an uninterrupted one-worker run,
because nothing here depends on timing: the split into shards is planned from the input alone, the
batches are a fixed function of a shard's samples, and torch's thread count is fixed for the run.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from peagle.pipeline import plan as P
from peagle.pipeline.atomic import remove_stale_temps
from peagle.pipeline.failpoints import failpoint
from peagle.pipeline.prefetch import prefetch
from peagle.pipeline.progress import Progress
from peagle.pipeline.store import (check_same_settings, init_store, list_commits, read_settings, rebuild_manifest,
                                   sha256_file)
from peagle.pipeline.store_reader import raw_bytes_per_token
from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.schemas.extract_config import ExtractConfig
from peagle.stages.extract.backend import TargetBackend, TargetOutput
from peagle.stages.extract.readers import check_data_path, count_records, iter_file_records
from peagle.stages.extract.regenerate import SamplingSettings, regenerate_records
from peagle.stages.extract.conversation import CONTAINS_MASK_TOKEN
from peagle.stages.extract.mask_token import describe_mask_token
from peagle.stages.extract.template import TokenizedSample, prepare_record
from peagle.stages.extract.target import Target, load_target, resolve_backend_name, store_settings
from peagle.stages.extract.writer import ShardContent, ShardWriter

ESTIMATE_RECORDS = 256  # records tokenized to estimate the token count of a large plan
PER_TURN_DROPPED = "per_turn_truncated_no_loss"  # per_turn samples cut to no loss (not record skips)
WRITER_THREADS = 2  # shards written at once: sha256 and file writes release the GIL



@dataclass(kw_only=True)
class PreparedShard:
    """A shard's records made into samples, with what was skipped and how."""

    shard: P.PlannedShard
    samples: list[TokenizedSample]
    skipped: Counter
    num_truncated: int = 0
    num_rendered_per_turn: int = 0


@dataclass(kw_only=True)
class ExtractPlan:
    settings: S.StoreSettings
    files: list[P.InputFile]
    shards: list[P.PlannedShard]  # every shard of the inputs
    mine: list[P.PlannedShard]  # this worker's
    pending: list[P.PlannedShard]  # this worker's, not yet committed
    estimated_tokens: int
    estimated_from_records: int
    estimated_mask_skips: int  # records of the estimate that contain the mask token
    free_bytes: int
    notes: list[str] = field(default_factory=list)  # things the user should know before it starts

    @property
    def estimated_bytes(self) -> int:
        return self.estimated_tokens * raw_bytes_per_token(self.settings)


@dataclass(kw_only=True)
class ExtractSummary:
    plan: ExtractPlan
    records: list[S.ShardRecord] = field(default_factory=list)
    work_seconds: float = 0.0  # from the first shard to the last commit (no model load, no planning)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.records)


# --------------------------------------------------------------------------------------------------
# Planning


def check_fits(plan: "ExtractPlan", root: Path) -> None:
    """Refuse to start when the estimated store does not fit on the disk (docs/store.md)."""
    if plan.estimated_bytes > plan.free_bytes:
        raise UserError(f"not enough disk for {root}: the plan needs ~{_human(plan.estimated_bytes)}, "
                        f"{_human(plan.free_bytes)} is free")


def input_files(paths: tuple[str, ...]) -> list[P.InputFile]:
    counts = count_records(paths)  # also checks every path (one-line errors)
    files = []
    for path, n in zip(paths, counts):
        try:
            digest = sha256_file(path)
        except OSError as err:
            raise UserError(f"cannot read data file {path}: {err.strerror or err}") from err
        files.append(P.InputFile(path=str(path), sha256=digest, num_records=n))
    return files


def make_plan(config: ExtractConfig, target: Target, settings: S.StoreSettings) -> ExtractPlan:
    """The plan, read-only: nothing is created, so ``--dry-run`` and a refused start leave no trace."""
    root = Path(config.out)
    files = input_files(config.data)
    exists = (root / S.STORE_SETTINGS_FILE).exists()
    if exists:
        existing = read_settings(root)
        if existing.mask_token_source is None:
            raise UserError(f"store {root} was written by an older peagle that recorded no mask token choice; "
                            "extract into a new --out (the old store still trains: `peagle train --mask-token-id N`)")
        check_same_settings(existing, settings, root)
    registrations = P.read_registrations(root) if exists else []
    new = P.assign_registrations(registrations, files, config.samples_per_shard)
    notes = [f"note: {r.name} is in the store already with other content: this content gets new shards "
             f"{r.first_shard}..{r.end_shard - 1}; the old shards stay" for r in new
             if any(old.name == r.name for old in registrations)]
    registrations += new
    shards = P.plan_shards(files, registrations)
    mine = P.shards_of_worker(shards, config.shard_index, config.num_shards)
    done = {r.index for r in list_commits(root)} if exists else set()
    pending = [s for s in mine if s.index not in done]
    tokens, sampled, mask_skips = estimate_tokens(pending, target.tokenizer, settings, config.loss_on)
    if mask_skips:
        notes.append(f"note: {mask_skips} of the {sampled} records read for the estimate contain the mask token "
                     f"{settings.mask_token_id}: such records are skipped (contains_mask_token); pass another "
                     "--mask-token-id if that is too many")
    probe = root if root.exists() else next((p for p in root.parents if p.exists()), Path("."))
    return ExtractPlan(settings=settings, files=files, shards=shards, mine=mine, pending=pending,
                       estimated_tokens=tokens, estimated_from_records=sampled, estimated_mask_skips=mask_skips,
                       free_bytes=shutil.disk_usage(probe).free, notes=notes)


def estimate_tokens(pending: list[P.PlannedShard], tokenizer: Any, settings: S.StoreSettings, loss_on: str,
                    max_records: int = ESTIMATE_RECORDS) -> tuple[int, int, int]:
    """(estimated tokens of the pending shards, records tokenized for it, how many of those contain
    the mask token): every record when there are at most ``max_records``, else the first records of
    up to 16 evenly spread shards, scaled."""
    total_records = sum(s.num_records for s in pending)
    if not total_records:
        return 0, 0, 0
    picks = pending if len(pending) <= 16 else [pending[i * len(pending) // 16] for i in range(16)]
    per_shard = max(1, max_records // len(picks))
    tokens = sampled = mask_skips = 0
    for shard in picks:
        stop = shard.end_record if total_records <= max_records else min(shard.end_record, shard.first_record + per_shard)
        for record in iter_file_records(shard.input_path, shard.first_record, stop):
            prepared = prepare_record(record, tokenizer, loss_on=loss_on, max_seq_len=settings.max_seq_len,
                                      mask_token_id=settings.mask_token_id)
            tokens += sum(len(s.input_ids) for s in prepared.samples)
            mask_skips += prepared.skip_reason == CONTAINS_MASK_TOKEN
            sampled += 1
    return round(tokens * total_records / max(sampled, 1)), sampled, mask_skips


def format_plan(plan: ExtractPlan, config: ExtractConfig, store: Path) -> str:
    s, t = plan.settings, plan.settings.target
    num_records = sum(f.num_records for f in plan.files)
    pending_records = sum(p.num_records for p in plan.pending)
    how = "exact" if plan.estimated_from_records >= pending_records else f"from {plan.estimated_from_records} records"
    lines = [
        f"peagle extract plan -> {store}",
        f"  target     {t.path} ({t.architecture}, {t.num_hidden_layers} layers, hidden {t.hidden_size}, "
        f"vocab {t.vocab_size}, {t.dtype})",
        f"  inputs     {len(plan.files)} file(s), {num_records} records -> {len(plan.shards)} shards "
        f"({config.samples_per_shard} records per shard)",
        f"  worker     {config.shard_index} of {config.num_shards}: {len(plan.mine)} shards, "
        f"{len(plan.mine) - len(plan.pending)} already committed, {len(plan.pending)} to do ({pending_records} records)",
        f"  settings   aux layers {','.join(map(str, s.aux_layer_ids))}, top-k {s.topk} ({s.logprob_dtype}), "
        f"max len {s.max_seq_len}, loss on {s.loss_on}, hidden states {s.hidden_dtype}"
        + ("" if s.supervise_reasoning else " (reasoning not supervised)"),
        f"  mask token {describe_mask_token(s.mask_token_id, s.mask_token, s.mask_token_source)}",
        f"  tokens     ~{plan.estimated_tokens:,} ({how})",
        f"  size       ~{_human(plan.estimated_bytes)} at {raw_bytes_per_token(s):,} bytes/token; "
        f"free disk {_human(plan.free_bytes)}",
        *plan.notes,
    ]
    return "\n".join(lines)


def _human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    raise AssertionError


# --------------------------------------------------------------------------------------------------
# Running


def make_batches(lengths: list[int], batch_size: int, max_batch_tokens: int) -> list[list[int]]:
    """Fixed batches of sample positions: longest first (little padding), at most ``batch_size``
    samples and ``max_batch_tokens`` padded tokens each. A pure function of the lengths."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches:
            last = batches[-1]
            width = lengths[last[0]]  # the first is the longest
            if len(last) < batch_size and width * (len(last) + 1) <= max_batch_tokens:
                last.append(i)
                continue
        batches.append([i])
    return batches


def open_backend(name: str, config: ExtractConfig, settings: S.StoreSettings, target: Target) -> TargetBackend:
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    if name == "vllm":
        from peagle.stages.extract.backend_vllm import VllmBackend  # imports vllm: only when asked for

        return VllmBackend(target.path, aux_layer_ids=list(settings.aux_layer_ids), topk=settings.topk,
                           dtype=settings.target.dtype, max_seq_len=settings.max_seq_len, seed=config.seed,
                           tensor_parallel_size=config.tensor_parallel_size,
                           gpu_memory_utilization=config.gpu_memory_utilization or None,
                           engine_kwargs=config.vllm_engine_kwargs())
    from peagle.stages.extract.backend_hf import HFBackend

    return HFBackend(target.path, aux_layer_ids=settings.aux_layer_ids, topk=settings.topk,
                     dtype=settings.target.dtype, device=config.device, pad_token_id=pad)


def run_forward(backend: TargetBackend, samples: list[TokenizedSample], config: ExtractConfig) -> list[TargetOutput]:
    """The target's outputs for a shard's samples, in sample order, computed in fixed batches."""
    lengths = [len(s.input_ids) for s in samples]
    if backend.name == "vllm":  # continuous batching: hand it everything, it schedules itself
        batches = [list(range(len(samples)))] if samples else []
    else:
        batches = make_batches(lengths, config.batch_size, config.max_batch_tokens)
    outputs: list[TargetOutput | None] = [None] * len(samples)

    def store(batch: list[int], results: list[TargetOutput]) -> None:
        for i, out in zip(batch, results):
            assert out.aux_TAH.shape[0] == lengths[i], "a backend must return one row per token"
            outputs[i] = out

    submit = getattr(backend, "submit", None)
    if submit is None:
        for batch in batches:
            failpoint("extract.forward")
            store(batch, backend.run([samples[i].input_ids for i in batch]))
        return outputs  # type: ignore[return-value]
    # Pipelined (hf): batch i+1 is queued on the device before batch i is collected, so the device
    # never waits for the host to take the previous batch's outputs.
    in_flight = None
    for batch in batches:
        failpoint("extract.forward")
        queued = (batch, submit([samples[i].input_ids for i in batch]))
        if in_flight is not None:
            store(in_flight[0], backend.collect(in_flight[1]))
        in_flight = queued
    if in_flight is not None:
        store(in_flight[0], backend.collect(in_flight[1]))
    return outputs  # type: ignore[return-value]


def prepare_shard(shard: P.PlannedShard, records: list, target: Target, settings: S.StoreSettings,
                  config: ExtractConfig) -> PreparedShard:
    """Records -> samples, with skip counts by reason, truncated samples and per-turn renders.

    Raises:
        UserError: ``--strict`` and a record is unusable (names file and line/row).
    """
    out = PreparedShard(shard=shard, samples=[], skipped=Counter())
    for record in records:
        prepared = prepare_record(record, target.tokenizer, loss_on=config.loss_on, max_seq_len=settings.max_seq_len,
                                  mask_token_id=settings.mask_token_id,
                                  supervise_reasoning=settings.supervise_reasoning)
        if prepared.skip_reason is not None:
            if config.strict:
                raise UserError(f"{record.where}: {prepared.skip_reason}"
                                + (f" ({prepared.skip_detail})" if prepared.skip_detail not in (None, prepared.skip_reason) else "")
                                + " [--strict]")
            out.skipped[prepared.skip_reason] += 1
            continue
        if prepared.num_dropped:
            out.skipped[PER_TURN_DROPPED] += prepared.num_dropped
        out.num_truncated += prepared.num_truncated
        out.num_rendered_per_turn += prepared.rendered_per_turn
        out.samples.extend(prepared.samples)
    return out


REGENERATE_WINDOW = 16  # shards regenerated together: bounds memory, and vLLM swaps engines once per window


def prepared_shards(pending: list[P.PlannedShard], backend: TargetBackend, target: Target,
                    settings: S.StoreSettings, config: ExtractConfig,
                    echo: Callable[[str], None] | None = None) -> Iterator[PreparedShard]:
    """Each pending shard's samples (regenerated first with ``--regenerate``), in order.

    With ``--regenerate`` a window of shards is regenerated before any of them is extracted: the
    vLLM backend needs a separate engine for generation, and starting two engines per shard would
    cost more than the work. Each shard's text depends only on its own seeds, so windows do not
    change the result.
    """
    sampling = SamplingSettings(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                top_p=config.top_p, seed=config.seed)
    window = REGENERATE_WINDOW if config.regenerate else 1
    for start in range(0, len(pending), window):
        chunk = pending[start:start + window]
        records_of = [list(iter_file_records(s.input_path, s.first_record, s.end_record)) for s in chunk]
        if config.regenerate:
            records_of = [regenerate_records(records, backend, target.tokenizer, sampling=sampling,
                                             shard_index=shard.index, batch_size=config.batch_size,
                                             max_seq_len=settings.max_seq_len, echo=echo)
                          for shard, records in zip(chunk, records_of)]
        for shard, records in zip(chunk, records_of):
            yield prepare_shard(shard, records, target, settings, config)


def run_extract(config: ExtractConfig, *, echo: Callable[[str], None] = print,
                progress: bool = True) -> ExtractSummary:
    """Plan, print the plan, and (unless ``dry_run``) extract this worker's missing shards.

    Raises:
        UserError: missing/unloadable target, unreadable data, store made with other settings, not
            enough disk, ``--strict`` and a bad record, disk full while writing.
    """
    import torch

    if config.threads:
        torch.set_num_threads(config.threads)
    for path in config.data:  # cheap checks first: a typo should not wait for transformers to import
        check_data_path(path)
    target = load_target(config.target)
    settings = store_settings(config, target)
    backend_name = resolve_backend_name(config.backend)
    root = Path(config.out)
    plan = make_plan(config, target, settings)
    echo(format_plan(plan, config, root))
    check_fits(plan, root)
    summary = ExtractSummary(plan=plan)
    if config.dry_run:
        return summary

    init_store(root, settings)
    for sub in (S.SHARDS_DIR, S.COMMITS_DIR, S.INPUTS_DIR, ""):
        remove_stale_temps(root / sub)
    registrations = P.register_inputs(root, plan.files, config.samples_per_shard)
    mine = P.shards_of_worker(P.plan_shards(plan.files, registrations), config.shard_index, config.num_shards)
    done = {r.index for r in list_commits(root)}
    pending = [s for s in mine if s.index not in done]
    if not pending:
        # A run killed between its last commit record and the manifest left the manifest stale.
        rebuild_manifest(root)
        echo("nothing to do: every shard of this worker is committed")
        return summary

    backend = open_backend(backend_name, config, settings, target)
    started = time.perf_counter()
    bar = Progress(sum(s.num_records for s in pending), desc="extract", unit="rec", enabled=progress)
    writer = ShardWriter(root, settings, num_threads=WRITER_THREADS,
                         on_commit=lambda r: bar.set_postfix(f"shard {r.index} committed, {r.num_tokens} tokens"))
    # a line per regeneration round: above a live bar, else with the other lines
    shards = prepared_shards(pending, backend, target, settings, config, echo=bar.write if progress else echo)
    if not config.regenerate:  # regeneration runs the backend, so it stays on this thread
        shards = prefetch(shards, depth=1)  # templating of shard s+1 overlaps the forward of shard s
    try:
        for prepared in shards:
            shard = prepared.shard
            outputs = run_forward(backend, prepared.samples, config)
            writer.submit(ShardContent(index=shard.index, input_name=shard.input_name,
                                       first_record=shard.first_record, end_record=shard.end_record,
                                       samples=prepared.samples, outputs=outputs, skipped=dict(prepared.skipped),
                                       num_truncated=prepared.num_truncated, backend=backend.name,
                                       num_rendered_per_turn=prepared.num_rendered_per_turn))
            bar.update(shard.num_records)
    except BaseException:
        _close_quietly(writer)  # shards already handed over are complete: let them commit
        raise
    finally:
        shards.close()
        bar.close()
        backend.close()
    summary.records = writer.close()
    summary.work_seconds = time.perf_counter() - started
    skipped_total = Counter()
    for r in summary.records:
        skipped_total.update(r.skipped)
    echo(f"committed {len(summary.records)} shards, {summary.num_tokens:,} tokens"
         + (f"; skipped {dict(sorted(skipped_total.items()))}" if skipped_total else ""))
    if skipped_total.get(CONTAINS_MASK_TOKEN):
        echo(f"warning: {skipped_total[CONTAINS_MASK_TOKEN]} records contain the mask token {settings.mask_token_id} "
             "and were skipped; `peagle store info` shows the counts")
    return summary


def _close_quietly(writer: ShardWriter) -> None:
    try:
        writer.close()
    except BaseException:  # the error already in flight is the one to report
        pass
