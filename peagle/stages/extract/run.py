"""The `peagle extract` driver: plan, then for each of this worker's missing shards, records ->
samples -> target forward in fixed batches -> write + commit (on the writer thread).

Re-running the same command finishes what is missing and never redoes what is committed (docs/reliability.md). With the hf backend the shards are byte-identical to an uninterrupted one-worker run,
because nothing here depends on timing: the split into shards is planned from the input alone, the
batches are a fixed function of a shard's samples, and torch's thread count is fixed for the run.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

from peagle.model.target.directory import TargetDirectory, open_target
from peagle.model.target.backend import TargetBackend, TargetOutput
from peagle.model.target.backend_choice import open_backend, resolve_backend_name
from peagle.pipeline import plan as P
from peagle.pipeline.failpoints import failpoint
from peagle.pipeline.prefetch import prefetch
from peagle.pipeline.progress import Progress
from peagle.pipeline.store import WriterLock, init_store, list_commits, rebuild_manifest, remove_stale_store_temps
from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.schemas.extract_config import ExtractConfig
from peagle.stages.extract.readers import check_has_records, iter_file_records
from peagle.stages.extract.regenerate import SamplingSettings, regenerate_records
from peagle.stages.extract.conversation import BLANK_LINE, CONTAINS_MASK_TOKEN
from peagle.stages.extract.input_check import NUM_EXAMPLES, BadRecord, check_input, words
from peagle.stages.extract.run_plan import ExtractPlan, check_fits, format_plan, make_plan
from peagle.stages.extract.template import TokenizedSample, prepare_record
from peagle.stages.extract.store_settings import generation_dtype, store_settings
from peagle.stages.extract.writer import ShardContent, ShardWriter

WRITER_THREADS = 2  # shards written at once: sha256 and file writes release the GIL



@dataclass(kw_only=True)
class PreparedShard:
    """A shard's records made into samples, with what was skipped and how."""

    shard: P.PlannedShard
    samples: list[TokenizedSample]
    skipped: Counter
    num_truncated: int = 0
    num_rendered_per_turn: int = 0
    examples: list[BadRecord] = field(default_factory=list)  # the first skipped records


@dataclass(kw_only=True)
class ExtractSummary:
    plan: ExtractPlan
    records: list[S.ShardRecord] = field(default_factory=list)
    work_seconds: float = 0.0  # from the first shard to the last commit (no model load, no planning)
    forward_seconds: float = 0.0  # the target's forwards, their outputs on the host (regeneration not counted)
    writer_wait_seconds: float = 0.0  # the driver blocked on the shard writer (a full queue, the last commits)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.records)


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


def prepare_shard(shard: P.PlannedShard, records: list, target: TargetDirectory, settings: S.StoreSettings,
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
            bad = BadRecord(record.where, prepared.skip_reason, prepared.skip_detail)
            if config.strict:
                raise UserError(f"{bad} [--strict]")
            out.skipped[prepared.skip_reason] += 1
            if len(out.examples) < NUM_EXAMPLES and prepared.skip_reason != BLANK_LINE:
                out.examples.append(bad)
            continue
        if prepared.num_dropped:
            out.skipped[S.PER_TURN_TRUNCATED_NO_LOSS] += prepared.num_dropped
        out.num_truncated += prepared.num_truncated
        out.num_rendered_per_turn += prepared.rendered_per_turn
        out.samples.extend(prepared.samples)
    return out


REGENERATE_WINDOW = 16  # vLLM: shards regenerated together (bounds memory; engines swap once per window)


def prepared_shards(pending: list[P.PlannedShard], backend: TargetBackend, target: TargetDirectory,
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
    # One shard at a time with the HF backend: it generates and extracts with one model, so a shard is
    # committed as soon as its answers exist (a run stopped early keeps them).
    window = REGENERATE_WINDOW if config.regenerate and backend.name == "vllm" else 1
    for start in range(0, len(pending), window):
        chunk = pending[start:start + window]
        records_of = [list(iter_file_records(s.input_path, s.first_record, s.end_record,
                                             max_record_bytes=config.max_record_bytes)) for s in chunk]
        if config.regenerate:
            records_of = [regenerate_records(records, backend, target.tokenizer, sampling=sampling,
                                             shard_index=shard.index,
                                             batch_size=settings.regenerate.get("generation_batch_size", 64),
                                             max_seq_len=settings.max_seq_len, echo=echo)
                          for shard, records in zip(chunk, records_of)]
        for shard, records in zip(chunk, records_of):
            yield prepare_shard(shard, records, target, settings, config)


def run_extract(config: ExtractConfig, *, echo: Callable[[str], None] = print,
                progress: bool = True) -> ExtractSummary:
    """Plan, print the plan, and (unless ``dry_run``) extract this worker's missing shards.

    Raises:
        UserError: missing/unloadable target (config, weights, tokenizer, chat template), unreadable or
            empty data, a data file changed since the store registered it, store made with other
            settings, not enough disk, ``--strict`` and a bad record, disk full while writing.
    """
    import torch

    if config.threads:
        torch.set_num_threads(config.threads)
    for path in config.data:  # cheap checks first: a typo should not wait for transformers to import
        check_has_records(path)
    # The target and the inputs are checked before the store exists (docs/reliability.md): config
    # and weights (open_target), tokenizer and chat template (store_settings), files (make_plan).
    target = open_target(config.target)
    settings = store_settings(config, target)
    backend_name = resolve_backend_name(config.backend)
    root = Path(config.out)
    plan = make_plan(config, target, settings)
    echo(format_plan(plan, config, root))
    check_fits(plan, root)
    summary = ExtractSummary(plan=plan)
    if config.dry_run:
        scan = plan.scan
        if config.strict and scan.examples:
            raise UserError(f"{scan.examples[0]} [--strict]")
        exact = plan.estimated_from_records >= sum(s.num_records for s in plan.pending)
        check_input(num_records=scan.num_records, skipped=scan.skipped, examples=scan.examples,
                    supervised_tokens=plan.estimated_supervised if exact else None,
                    max_skipped_share=config.max_skipped_share, what="the dry run")
        return summary
    with WriterLock(root) as writers:  # held for as long as this run may write (init_store's restart)
        return extract_pending(config, plan, target, backend_name, writers, summary, echo=echo, progress=progress)


def extract_pending(config: ExtractConfig, plan: ExtractPlan, target: TargetDirectory, backend_name: str,
                    writers: WriterLock, summary: ExtractSummary, *, echo: Callable[[str], None],
                    progress: bool) -> ExtractSummary:
    """Join (or create, or restart) the store, register the inputs and extract this worker's missing
    shards; ``writers`` held shared by the caller."""
    root, settings = Path(config.out), plan.settings
    init_store(root, settings, writers=writers, restart=plan.restart, plan=plan.registrations)
    remove_stale_store_temps(root)
    if plan.dropped:  # --replace-changed-inputs
        if not writers.alone():
            raise UserError(f"another extract is writing to store {root}; --replace-changed-inputs needs the "
                            "store to itself: run it again once that one has finished")
        try:
            P.drop_registrations(root, plan.dropped)
            rebuild_manifest(root)
        finally:
            writers.share()
    registrations = P.register_inputs(root, plan.files, config.samples_per_shard)
    mine = P.shards_of_worker(P.plan_shards(plan.files, registrations), config.shard_index, config.num_shards)
    done = {r.index for r in list_commits(root)}
    pending = [s for s in mine if s.index not in done]
    if not pending:
        # A run killed between its last commit record and the manifest left the manifest stale.
        rebuild_manifest(root)
        echo("nothing to do: every shard of this worker is committed")
        check_worker_input(root, mine, [], config)  # as loud as the run that committed them
        return summary

    backend = open_backend(backend_name, target, max_seq_len=settings.max_seq_len,
                           aux_layer_ids=settings.aux_layer_ids, topk=settings.topk, dtype=settings.target.dtype,
                           generation_dtype=generation_dtype(config),  # resolved once, as the settings record it
                           seed=config.seed, device=config.device, generation=config.generation,
                           tensor_parallel_size=config.tensor_parallel_size,
                           gpu_memory_utilization=config.gpu_memory_utilization or None,
                           engine_kwargs=config.vllm_engine_kwargs())
    started = time.perf_counter()
    bar = Progress(sum(s.num_records for s in pending), desc="extract", unit="rec", enabled=progress)
    writer = ShardWriter(root, settings, num_threads=WRITER_THREADS,
                         on_commit=lambda r: bar.set_postfix(f"shard {r.index} committed, {r.num_tokens} tokens"))
    # a line per regeneration round: above a live bar, else with the other lines
    shards = prepared_shards(pending, backend, target, settings, config, echo=bar.write if progress else echo)
    if not config.regenerate:  # regeneration runs the backend, so it stays on this thread
        shards = prefetch(shards, depth=1)  # templating of shard s+1 overlaps the forward of shard s
    examples: list[BadRecord] = []
    try:
        for prepared in shards:
            shard = prepared.shard
            examples += prepared.examples[:NUM_EXAMPLES - len(examples)]
            forward_started = time.perf_counter()
            outputs = run_forward(backend, prepared.samples, config)
            submit_started = time.perf_counter()
            summary.forward_seconds += submit_started - forward_started
            writer.submit(ShardContent(index=shard.index, input_name=shard.input_name,
                                       first_record=shard.first_record, end_record=shard.end_record,
                                       samples=prepared.samples, outputs=outputs, skipped=dict(prepared.skipped),
                                       num_truncated=prepared.num_truncated, backend=backend.name,
                                       num_rendered_per_turn=prepared.num_rendered_per_turn))
            summary.writer_wait_seconds += time.perf_counter() - submit_started
            bar.update(shard.num_records)
    except BaseException:
        _close_quietly(writer)  # shards already handed over are complete: let them commit
        raise
    finally:
        shards.close()
        bar.close()
        backend.close()
    closing = time.perf_counter()
    summary.records = writer.close()
    summary.work_seconds = time.perf_counter() - started
    summary.writer_wait_seconds += time.perf_counter() - closing
    skipped_total = Counter()
    for r in summary.records:
        skipped_total.update(r.skipped)
    supervised = sum(r.num_supervised_tokens for r in summary.records)
    if summary.records:  # where the time went: a writer that keeps the target waiting is a slow disk or CPU
        rest = summary.work_seconds - summary.forward_seconds - summary.writer_wait_seconds
        echo(f"  time       {summary.work_seconds:.1f} s: target forward {summary.forward_seconds:.1f} s, "
             f"waiting for the shard writer {summary.writer_wait_seconds:.1f} s, "
             f"{'regenerating answers and ' if config.regenerate else ''}templating {rest:.1f} s")
    echo(f"committed {len(summary.records)} shards, {summary.num_tokens:,} tokens ({supervised:,} supervised)"
         + (f"; skipped {words(skipped_total)}" if skipped_total else ""))
    if skipped_total.get(CONTAINS_MASK_TOKEN):
        echo(f"warning: {skipped_total[CONTAINS_MASK_TOKEN]} records contain the mask token {settings.mask_token_id} "
             "and were skipped; `peagle store info` shows the counts")
    check_worker_input(root, mine, examples, config)
    return summary


def check_worker_input(root: Path, mine: list[P.PlannedShard], examples: list[BadRecord],
                       config: ExtractConfig) -> None:
    """``check_input`` over every shard of this worker, from their commit records: a killed and re-run
    worker fails as the uninterrupted one would (``examples``: the bad records this run saw)."""
    indices = {s.index for s in mine}
    records = [r for r in list_commits(root) if r.index in indices]
    skipped: Counter = Counter()
    for r in records:
        skipped.update(r.skipped)
    counted = all(r.token_counts or not r.num_samples for r in records)  # older records did not count
    supervised = sum(r.num_supervised_tokens for r in records)
    try:
        check_input(num_records=sum(r.num_records for r in records), skipped=skipped, examples=examples,
                    supervised_tokens=supervised if counted else None, max_skipped_share=config.max_skipped_share,
                    what="extraction")
    except UserError as err:
        if any(r.usable for r in list_commits(root)):
            raise
        raise UserError(f"{err}; store {root} holds no usable sample, so every reader refuses it and the same "
                        "command, once mended, starts it afresh") from err


def _close_quietly(writer: ShardWriter) -> None:
    try:
        writer.close()
    except BaseException:  # the error already in flight is the one to report
        pass
