"""Write one shard's two files and commit it, on a writer thread that overlaps the model's compute.

Files are byte-identical for identical input (docs/reliability.md: a killed and resumed run, or n workers
instead of one, give the same store): the Parquet file is written with fixed settings and no
varying metadata (``shard_parquet.write_parquet``), and the safetensors file is serialised directly
(``shard_tensors.write_tensors``: header, then each tensor's rows sample by sample), which also avoids
concatenating a shard's tensors into one more copy. Both go to disk and are committed by the one
commit protocol (``peagle.pipeline.shard_commit.write_and_commit_shard``).
An fp8 store's rows are quantised as they are encoded (``peagle.pipeline.shard_tensors.encode_sample``),
and the shard's content statistics (``peagle.pipeline.shard_stats``) are computed from exactly the
encoded rows and committed with it.

``ShardWriter`` runs ``write_and_commit`` on a background thread fed by a bounded queue of whole
shards: the model computes shard s+1 while shard s goes to disk, and waits only when the disk is
more than one shard behind. An error on the writer thread (disk full) is re-raised in the caller at
its next ``submit`` or at ``close``.

Shape legend: T tokens of the shard, A aux layers, H hidden size, K top-k.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from peagle.model.target.backend import TargetOutput
from peagle.pipeline.raw_reader import raw_sample
from peagle.pipeline.shard_commit import write_and_commit_shard
from peagle.pipeline.shard_parquet import parquet_table, write_parquet
from peagle.pipeline.shard_stats import sample_rows, shard_stats
from peagle.pipeline.shard_tensors import encode_sample, write_tensors
from peagle.schemas import store as S
from peagle.stages.extract.template import TokenizedSample

@dataclass(kw_only=True)
class ShardContent:
    """Everything that becomes one shard: its samples with the target's outputs, and its counts."""

    index: int
    input_name: str
    first_record: int
    end_record: int
    samples: list[TokenizedSample]
    outputs: list[TargetOutput]
    skipped: dict[str, int] = field(default_factory=dict)
    num_truncated: int = 0
    backend: str = ""
    num_rendered_per_turn: int = 0


def sum_token_counts(samples: list[TokenizedSample]) -> dict[str, int]:
    """The shard's token counts by kind and role (``token_kinds``), summed over its samples."""
    total: dict[str, int] = {}
    for sample in samples:
        for key, n in sample.token_counts.items():
            total[key] = total.get(key, 0) + n
    return dict(sorted(total.items()))


def encoded_shard(content: ShardContent, settings: S.StoreSettings
                  ) -> tuple[ShardContent, list[dict[str, torch.Tensor]], S.ShardStats]:
    """Every sample's stored tensors, and the shard's statistics computed from exactly those.

    A sample whose aux states as stored or whose top-k log-probs hold NaN/inf (docs/reliability.md) is
    dropped and counted as ``non_finite_target``. The states are judged on the stored rows, so one
    pass of row facts serves both the drop and the statistics, and a value that only overflows when
    rounded to bf16 is caught too (it would be a non-finite row that `peagle train` refuses).
    Returns the content that is written (the kept samples), their tensors and the statistics.
    """
    keep, encoded, rows = [], [], []
    for i, (sample, out) in enumerate(zip(content.samples, content.outputs, strict=True)):
        parts = encode_sample(out.aux_TAH, out.topk_ids_TK, out.topk_logprobs_TK, settings)
        facts = sample_rows(raw_sample(sample.sample_id, sample.input_ids, sample.loss_mask, parts))
        if facts.non_finite_nA.any() or not bool(torch.isfinite(out.topk_logprobs_TK).all()):
            continue  # (the stored log-probs are clamped to their dtype's range: the target's own say)
        keep.append(i)
        encoded.append(parts)
        rows.append(facts)
    num_dropped = len(content.samples) - len(keep)
    if num_dropped:
        skipped = dict(content.skipped)
        skipped[S.NON_FINITE_TARGET] = skipped.get(S.NON_FINITE_TARGET, 0) + num_dropped
        content = replace(content, samples=[content.samples[i] for i in keep],
                          outputs=[content.outputs[i] for i in keep], skipped=skipped)
    return content, encoded, shard_stats(rows, settings)


def write_and_commit(root: Path, content: ShardContent, settings: S.StoreSettings) -> S.ShardRecord:
    """The shard's commit record from ``content``, its two files written and the record committed
    (``shard_commit.write_and_commit_shard``): the shard exists from then on."""
    content, encoded, stats = encoded_shard(content, settings)
    table = parquet_table(content.samples)
    record = S.ShardRecord(
        index=content.index, parquet=S.parquet_name(content.index), safetensors=S.tensors_name(content.index),
        num_samples=len(content.samples), num_tokens=sum(len(s.input_ids) for s in content.samples),
        parquet_bytes=0, safetensors_bytes=0, parquet_sha256="", safetensors_sha256="",  # measured as written
        input_file=content.input_name, first_record=content.first_record,
        end_record=content.end_record, num_records=content.end_record - content.first_record,
        skipped={k: v for k, v in content.skipped.items() if v}, num_truncated=content.num_truncated,
        backend=content.backend, stats=stats, token_counts=sum_token_counts(content.samples),
        num_supervised_turns=sum(s.num_turns for s in content.samples),
        num_rendered_per_turn=content.num_rendered_per_turn,
    )
    return write_and_commit_shard(root, record, write_rows=lambda tmp: write_parquet(table, tmp),
                                  write_tensors=lambda tmp: write_tensors(tmp, encoded, settings))


class ShardWriter:
    """Background threads that write and commit submitted shards.

    ``max_pending`` shards may wait in the queue (each holds its tensors in memory); ``submit`` blocks
    when the queue is full, so memory stays bounded and the model waits only on a slow disk. With
    ``num_threads`` > 1 several shards are written at once (torch's ops, file writes and sha256 release
    the GIL); commit order then varies, which nothing depends on: each commit record stands alone and
    the manifest is derived from all of them. Each writer thread runs torch on one core, passing over
    the states in cache-sized chunks (``peagle.pipeline.fp8.chunk_rows``); the bytes are those of any
    other thread count. ``on_commit`` runs on a writer thread after each commit.
    """

    _STOP = object()

    def __init__(self, root: Path, settings: S.StoreSettings, *, max_pending: int = 1, num_threads: int = 1,
                 on_commit=None) -> None:
        self.root, self.settings, self.on_commit = root, settings, on_commit
        self.records: list[S.ShardRecord] = []
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        num_torch_threads = torch.get_num_threads()  # this thread's, and the default of threads to come
        started = threading.Barrier(num_threads + 1)
        self._threads = [threading.Thread(target=self._loop, args=(started,), name=f"peagle-shard-writer-{i}",
                                          daemon=True) for i in range(num_threads)]
        for t in self._threads:
            t.start()
        started.wait()
        # torch.set_num_threads also sets the count that threads started from now on begin with: put
        # back the caller's, now that every writer thread has set its own.
        torch.set_num_threads(num_torch_threads)

    def _loop(self, started: threading.Barrier) -> None:
        # One core for this thread's torch ops (the shard's own work runs in chunks that stay in the
        # cache; several shards at once are the parallelism). torch's OpenMP teams on a loaded machine
        # wait for each other at every op: 10-20x slower fp8 encoding on 2 shared cores
        # (benchmarks/writer_throughput.py). The count is per thread once the thread has read it.
        torch.get_num_threads()
        torch.set_num_threads(1)
        started.wait()
        while (item := self._queue.get()) is not self._STOP:
            if self._error is not None:
                continue  # drain: after a failure nothing more is written
            try:
                record = write_and_commit(self.root, item, self.settings)
                with self._lock:
                    self.records.append(record)
                if self.on_commit is not None:
                    self.on_commit(record)
            except BaseException as err:  # handed to the caller's thread
                self._error = self._error or err

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, content: ShardContent) -> None:
        self._raise_if_failed()
        self._queue.put(content)

    def close(self) -> list[S.ShardRecord]:
        """Wait until every submitted shard is committed; re-raise a writer error. Returns the
        records, by shard index."""
        for _ in self._threads:
            self._queue.put(self._STOP)
        for t in self._threads:
            t.join()
        self._raise_if_failed()
        return sorted(self.records, key=lambda r: r.index)
