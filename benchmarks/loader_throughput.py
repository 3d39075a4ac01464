"""Loader throughput on an 8B-shaped synthetic store: can DataLoader workers keep the GPU fed?

    python benchmarks/loader_throughput.py --out /tmp/peagle-bench --json loader_throughput.json
    python benchmarks/loader_throughput.py --hidden-dtype bf16 fp8 --lengths 8192 --segments 1 \
        --attention sdpa --workers 1 --json loader_throughput_fp8.json

Builds (once; reused when present) one store per row length L and hidden-state encoding, shaped like
an 8B target: hidden 4096, 3 aux layers, top-32 float16 log-probs (24,768 bytes/token in bf16,
12,492 in fp8: float8 codes plus a float32 scale per token and layer), random tensors written
through the real store writer (``init_store`` + ``shard_commit.write_and_commit_shard``). Each sample has n = L + 1
tokens (one row of L training positions per batch, as the reference harness runs) and supervises
every position but the first (docs/performance.md), so COD lengths match the reference (~27.6k at L = 8192).

Measured per (L, S, attention), with K = 8, r = 0.7, r_min = 0.2, on one CPU thread (= one worker):

* worker side -- ``build_ms``: one whole batch as a worker builds it (``ShardStream.build``: Parquet
  columns, mmap'd top-k rows, COD, packing, targets at supervised elements, segment plans, block
  indices; the aux rows stay on disk), page cache warm; ``build_cold_ms`` after evicting the shard
  files from the page cache (posix_fadvise, these files only); ``items_ms`` (index shifting + COD
  draw) and ``collate_ms`` (the rest) break it down; ``transfer_ms``: pickling the batch into shared
  memory and unpickling it, as between a worker and the trainer; ``worker_ms_per_batch`` = build +
  transfer, one worker's cost per batch; ``dataloader_batches_per_s_wW``: batches/s that real
  DataLoader workers deliver to this process (meaningful only with W + 2 free cores);
* trainer side -- ``aux_read_ms``: the pin thread's read of the batch's aux rows (``AuxSource``,
  preadv; fp8: codes and scales) into a reused buffer, as into the CUDA host allocator's cached
  pinned blocks; ``_cold`` with the page cache evicted; ``aux_read_fresh_memory_ms`` into fresh
  memory (every page faulted in: what copying the rows in a worker and shipping them through shared
  memory costs, twice); ``aux_bytes_per_batch``: what it reads, which is also what the
  host-to-device copy moves (fp8 batches are dequantised on the device);
* end to end -- ``loader_items_per_s_wW``: samples per second out of ``TrainLoader`` with W workers,
  the aux rows read as the GPU trainer's pin thread reads them (fp8 left as codes); for fp8 also
  ``cpu_path_build_ms``: a worker's build when it dequantises the rows itself (CPU training);
* the content check (docs/store.md: every shard file's crc32 compared with its commit record the
  first time a process of the opened store maps it) -- ``--content-checks on off`` (the default) times
  the loader both ways, in turns, ``--repeats`` times each (medians): ``loader_items_per_s_wW`` with
  the checks, as ``peagle train`` runs, ``loader_items_per_s_wW_unchecked`` on a twin of the store
  whose commit records hold no checksums (the same files, hard-linked: read by size, as a store from
  before the checksums), and ``content_check_cost_wW`` = 1 − checked/unchecked items/s. Each file is
  checked once per opened store, so the timed batches (less than the small store's first epoch)
  carry the whole cost; ``crc32_gib_per_s`` is zlib's crc32 on one core, ``crc32_blocks_gib_per_s`` the
  check's own block sums (pieces on its thread pool), page cache warm.

From ``worker_ms_per_batch`` (warm cache; a cold build adds the top-k page-ins) it derives the
workers needed for < 2% data wait at the reference GPU step times (one H100, L = 8192: 190 ms/step
with 1 draft layer, 491 ms with 4): with prefetching, the trainer waits only when the workers
together deliver fewer than one batch per step, so
W = ceil(worker_ms / step_ms) suffices in steady state (``recommended_workers`` adds one for
jitter); the pin thread, one per rank, must read one batch's aux rows per step
(``pin_thread_share_of_step`` < 1). On a machine with fewer free cores than W + 2 (trainer, pin
thread, workers) the W-worker rates cannot scale.
"""

from __future__ import annotations

import argparse
import io
import json
import mmap
import shutil
import zlib
import math
import os
import pickle
import platform
import statistics
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (registers the shared-memory reductions of tensors)

from peagle.pipeline import fp8
from peagle.pipeline.content_check import block_crc32
from peagle.pipeline.shard_commit import write_and_commit_shard
from peagle.pipeline.store import init_store, open_store, rebuild_manifest
from peagle.pipeline.shard_tensors import raw_bytes_per_token
from peagle.pipeline.store_reader import ShardReader
from peagle.schemas import store as S
from peagle.schemas.loader_config import CodSettings, LoaderConfig
from peagle.schemas.train_config import StoreSpec
from peagle.stages.train.batch import collate, make_item
from torch.utils.data import DataLoader

from peagle.stages.train.loader import ShardStream, TrainLoader
from peagle.stages.train.vocab import build_draft_vocab, load_draft_vocab

HIDDEN, AUX_LAYERS, TOPK, TARGET_VOCAB, DRAFT_VOCAB = 4096, (2, 16, 29), 32, 128256, 32000
REFERENCE_STEP_MS = {"1_layer": 190.0, "4_layers": 491.0}  # one H100, L = 8192 (shared/anchors)


def settings_for(max_len: int, *, hidden: int = HIDDEN, vocab: int = TARGET_VOCAB, topk: int = TOPK,
                 content_hash: str = "synthetic", hidden_dtype: str = S.HIDDEN_BF16) -> S.StoreSettings:
    """Store settings of a synthetic target (8B-shaped by default; the train-run benchmark passes toy
    shapes, and the content hash of the target directory it writes)."""
    return S.StoreSettings(
        target=S.TargetIdentity(path="synthetic-8b", architecture="LlamaForCausalLM", num_hidden_layers=32,
                                hidden_size=hidden, vocab_size=vocab, dtype="bfloat16",
                                content_hash=content_hash),
        tokenizer_fingerprint="synthetic", chat_template_hash="synthetic", aux_layer_ids=AUX_LAYERS, topk=topk,
        max_seq_len=max_len, logprob_dtype="float16", loss_on="all", mask_token_id=vocab - 1,
        hidden_dtype=hidden_dtype)


def build_store(root: Path, seq_len: int, num_samples: int, samples_per_shard: int, *,
                sample_tokens: list[int] | None = None, settings: S.StoreSettings | None = None,
                hidden_dtype: str = S.HIDDEN_BF16, workers: int = 1) -> Path:
    """Write a synthetic store (skipped when one with these settings and sizes is committed already).

    Every sample has ``seq_len + 1`` tokens unless ``sample_tokens`` gives each sample's token count
    (``num_samples`` is then its length). ``settings`` defaults to the 8B shapes (:func:`settings_for`)
    in ``hidden_dtype``. ``workers`` > 1 generates, writes and commits the shards in that many
    processes (the manifest is rebuilt once more at the end): seconds instead of minutes for a store
    of GBs.
    """
    sizes = list(sample_tokens) if sample_tokens is not None else [seq_len + 1] * num_samples
    settings = settings or settings_for(max(sizes), hidden_dtype=hidden_dtype)
    num_shards = -(-len(sizes) // samples_per_shard)
    if (root / S.MANIFEST_FILE).exists():
        shards = open_store(root).shards
        if len(shards) == num_shards and all(r.parquet_crc32 and r.safetensors_crc32 for r in shards):
            return root  # (a store from before the checksums is written again)
        shutil.rmtree(root)
    init_store(root, settings)
    jobs = [(root, index, sizes[index * samples_per_shard:(index + 1) * samples_per_shard],
             index * samples_per_shard, seq_len, settings) for index in range(num_shards)]
    if workers > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(workers, num_shards), initializer=torch.set_num_threads, initargs=(1,)) as pool:
            list(pool.map(_write_shard, *zip(*jobs)))
    else:
        for job in jobs:
            _write_shard(*job)
    rebuild_manifest(root)  # commits from several processes: the last manifest lists them all
    return root


def _write_shard(root: Path, index: int, shard_sizes: list[int], first: int, seq_len: int,
                 settings: S.StoreSettings) -> S.ShardRecord:
    """Shard ``index``'s two files, random content seeded by (seq_len, index), committed; its record."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from safetensors.torch import save

    hidden, vocab, topk = settings.target.hidden_size, settings.target.vocab_size, settings.topk
    gen = torch.Generator().manual_seed(seq_len * 100003 + index)
    count, tokens = len(shard_sizes), sum(shard_sizes)
    ids = [torch.randint(0, vocab - 1, (n,), generator=gen, dtype=torch.int32).tolist() for n in shard_sizes]
    # Shifted mask m[p] = loss_mask[p+2]: every position but the first (and the last) is supervised.
    mask = [[0] * min(n, 3) + [1] * max(n - 3, 0) for n in shard_sizes]
    # Top-k ids skewed to low ids (so most fall in the draft vocab), log-probs descending.
    topk_ids = (torch.rand(tokens, topk, generator=gen) ** 3 * (vocab - 1)).to(torch.int32)
    logits = torch.randn(tokens, topk, generator=gen).sort(dim=-1, descending=True).values
    aux = torch.randn(tokens, len(settings.aux_layer_ids), hidden, generator=gen, dtype=torch.bfloat16)
    tensors = {S.AUX_HIDDEN: aux}
    if settings.hidden_dtype == S.HIDDEN_FP8:
        tensors[S.AUX_HIDDEN], tensors[S.AUX_SCALE] = fp8.quantize(aux)
    tensors.update({S.TOPK_IDS: topk_ids, S.TOPK_LOGPROBS: (logits.log_softmax(-1) - 0.1).to(torch.float16)})
    offsets = [sum(shard_sizes[:i]) for i in range(count)]
    table = pa.table({
        "sample_id": [f"L{seq_len}-{index}-{i}" for i in range(count)],
        "source": [f"synthetic:{first + i}" for i in range(count)],
        "input_ids": pa.array(ids, type=pa.list_(pa.int32())),
        "loss_mask": pa.array(mask, type=pa.list_(pa.uint8())),
        "num_tokens": pa.array(shard_sizes, type=pa.int64()),
        "token_offset": pa.array(offsets, type=pa.int64()),
    })

    def write_parquet(path):
        buf = io.BytesIO()
        pq.write_table(table, buf)
        Path(path).write_bytes(buf.getvalue())

    def write_tensors(path):
        Path(path).write_bytes(save(tensors))

    record = S.ShardRecord(
        index=index, parquet=S.parquet_name(index), safetensors=S.tensors_name(index), num_samples=count,
        num_tokens=tokens, parquet_bytes=0, safetensors_bytes=0, parquet_sha256="", safetensors_sha256="",
        input_file="synthetic", first_record=first, end_record=first + count, num_records=count, backend="synthetic")
    return write_and_commit_shard(root, record, write_rows=write_parquet, write_tensors=write_tensors)


def evict(store_root: Path) -> None:
    """Drop the store's shard files from the page cache (only these files; nothing system-wide)."""
    for path in (store_root / S.SHARDS_DIR).glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def unchecked_twin(root: Path) -> Path:
    """The store as one committed before content checksums: its files hard-linked (the same inodes, so
    the same page cache), its commit records without ``*_crc32``. Read by size only."""
    twin = root.with_name(root.name + "-unchecked")
    shutil.rmtree(twin, ignore_errors=True)
    (twin / S.SHARDS_DIR).mkdir(parents=True)
    (twin / S.COMMITS_DIR).mkdir()
    shutil.copyfile(root / S.STORE_SETTINGS_FILE, twin / S.STORE_SETTINGS_FILE)
    for path in (root / S.SHARDS_DIR).iterdir():
        if not path.name.startswith("."):
            os.link(path, twin / S.SHARDS_DIR / path.name)
    for path in (root / S.COMMITS_DIR).glob("[0-9]*.json"):
        record = json.loads(path.read_text())
        (twin / S.COMMITS_DIR / path.name).write_text(json.dumps({k: v for k, v in record.items()
                                                                   if not k.endswith("_crc32")}))
    return twin


def crc32_gib_per_s(root: Path) -> dict[str, float]:
    """GiB/s of zlib.crc32 over the store's tensor files on one core, and of the content check's own
    block sums (``content_check.block_crc32``: pieces on its thread pool), page cache warm."""
    total, seconds = 0, {"crc32_gib_per_s": 0.0, "crc32_blocks_gib_per_s": 0.0}
    for path in sorted((root / S.SHARDS_DIR).glob("[0-9]*.safetensors")):
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        view = memoryview(data)
        zlib.crc32(view)  # page it in
        for key, run in (("crc32_gib_per_s", lambda: zlib.crc32(view)),
                         ("crc32_blocks_gib_per_s", lambda: [block_crc32(view[i:i + S.CRC32_BLOCK_BYTES])
                                                             for i in range(0, len(view), S.CRC32_BLOCK_BYTES)])):
            t0 = time.perf_counter()
            run()
            seconds[key] += time.perf_counter() - t0
        total += len(data)
        view.release()
    return {key: round(total / 2**30 / s, 2) for key, s in seconds.items()}


def loader_config(root: Path, seq_len: int, segments: int, attention: str, workers: int = 0,
                  dequantize_in_workers: bool = False) -> LoaderConfig:
    """The GPU trainer's stream by default: fp8 rows stay codes until the device."""
    return LoaderConfig(stores=(StoreSpec(str(root)),), seed=0, token_budget=seq_len,
                        cod=CodSettings(num_depths=8, down_sample_ratio=0.7, down_sample_ratio_min=0.2),
                        sequence_partitions=segments, attention=attention, num_workers=workers,
                        dequantize_in_workers=dequantize_in_workers)


def measure_batch(loader: TrainLoader, root: Path, b: int, buffers: dict) -> dict:
    """Timings (seconds) of one batch ``b``: one worker's work, in this process (torch uses one thread,
    as in a worker), and the trainer-side read of its aux rows (what the pin thread does)."""
    cfg = loader.config
    epoch, batch = divmod(b, loader.num_batches)
    plan = loader.plan(epoch)
    refs = plan.refs_of_rank[0]
    loc = np.stack([loader.index.store_of[refs], loader.index.shard_of[refs], loader.index.row_of[refs]])
    stream = ShardStream(loader.stores, cfg, loc_3B=loc, bounds=plan.bounds_of_rank[0],
                         num_batches=plan.num_batches, start=0, epoch=epoch,
                         target_to_draft_V=loader.target_to_draft_V)
    got: dict = {}
    for name, cold_cache in (("build_cold", True), ("build", False)):
        if cold_cache:
            evict(root)
        t0 = time.perf_counter()
        out = stream.build(ShardReader(loader.stores, capacity=8), batch)
        got[name] = time.perf_counter() - t0
    got["elements"], got["supervised"] = out.num_elements, out.num_supervised
    t0 = time.perf_counter()  # what sending the batch to the trainer process costs (shared memory)
    pickle.loads(ForkingPickler.dumps(out))
    got["transfer"] = time.perf_counter() - t0

    # The trainer side: aux rows from the file into a reused buffer (as into cached pinned memory),
    # page cache warm and cold, and into fresh memory (every page faulted in: the cost workers avoid).
    src = out.aux_source
    if buffers.get("shape") != tuple(src.shape):
        buffers.update(shape=tuple(src.shape), values=torch.zeros(src.shape, dtype=src.dtype),
                       scales=torch.zeros(src.shape[:2], dtype=fp8.SCALE_DTYPE) if src.scale_reads else None)
    for name, fresh, evict_first in (("aux_cold", False, True), ("aux_warm", False, False), ("aux_fresh", True, False)):
        if evict_first:
            evict(root)
        t0 = time.perf_counter()
        if fresh:
            src.read()
        else:
            src.read_into(buffers["values"], buffers["scales"])
        got[name] = time.perf_counter() - t0
    got["aux_bytes"] = src.num_bytes

    # Breakdown of the worker's build (warm cache): items (shift + COD), then collate.
    reader = ShardReader(loader.stores, capacity=8)
    lo, hi = plan.bounds_of_rank[0][batch], plan.bounds_of_rank[0][batch + 1]
    t0 = time.perf_counter()
    items = []
    for i in range(lo, hi):
        s, j, row = (int(v) for v in loc[:, i])
        items.append(make_item(reader.sample(s, j, row), cod=cfg.cod, seed=cfg.seed, epoch=epoch))
    t1 = time.perf_counter()
    collate(items, target_to_draft_V=loader.target_to_draft_V,
            num_segments=cfg.sequence_partitions, block_size=cfg.block_size if cfg.attention == "flex" else None,
            aux_reads=[(("", 0, 0), None)] * len(items))
    got["items"], got["collate"] = t1 - t0, time.perf_counter() - t1
    return got


def summarize(batches: list[dict], token_budget: int) -> dict:
    """Medians over measured batches, in ms (the keys the module docstring explains)."""
    def ms(key: str) -> float:
        return round(1000 * statistics.median(b[key] for b in batches), 1)

    build = statistics.median(b["build"] for b in batches)
    return {
        "build_ms": ms("build"), "build_cold_ms": ms("build_cold"), "items_ms": ms("items"),
        "collate_ms": ms("collate"), "transfer_ms": ms("transfer"),
        "worker_ms_per_batch": round(1000 * statistics.median(b["build"] + b["transfer"] for b in batches), 1),
        "aux_read_ms": ms("aux_warm"), "aux_read_cold_ms": ms("aux_cold"), "aux_read_fresh_memory_ms": ms("aux_fresh"),
        "aux_mib": round(batches[0]["aux_bytes"] / 2**20, 1), "aux_bytes_per_batch": batches[0]["aux_bytes"],
        "cod_elements": int(statistics.median(b["elements"] for b in batches)),
        "supervised_elements": int(statistics.median(b["supervised"] for b in batches)),
        "items_per_s": round(1 / build, 2), "tokens_per_s": round(token_budget / build),
    }


def time_cpu_builds(loader: TrainLoader, num_batches: int) -> float:
    """Median ms of one worker's build when it also reads and dequantises the aux rows (CPU training)."""
    plan = loader.plan(0)
    refs = plan.refs_of_rank[0]
    loc = np.stack([loader.index.store_of[refs], loader.index.shard_of[refs], loader.index.row_of[refs]])
    stream = ShardStream(loader.stores, loader.config, loc_3B=loc, bounds=plan.bounds_of_rank[0],
                         num_batches=plan.num_batches, start=0, epoch=0,
                         target_to_draft_V=loader.target_to_draft_V)
    times = []
    for b in range(num_batches):
        t0 = time.perf_counter()
        out = stream.build(ShardReader(loader.stores, capacity=8), b % plan.num_batches)
        times.append(time.perf_counter() - t0)
        assert out.aux_TAH is not None and out.aux_scale_TA is None
    return round(1000 * statistics.median(times), 1)


def time_loader(config: LoaderConfig, vocab, num_batches: int) -> float:
    """Samples/s out of ``TrainLoader`` (its workers, then the aux rows read in this process as the pin
    thread would), over ``num_batches`` after a first warm-up batch."""
    loader = TrainLoader(config, vocab=vocab)
    got, items, t0 = 0, 0, None
    for batch in loader.stream():
        got += 1
        if got == 1:
            t0 = time.perf_counter()
            continue
        items += batch.num_samples
        if got == num_batches + 1:
            break
    return round(items / (time.perf_counter() - t0), 3)


def time_dataloader(loader: TrainLoader, workers: int, num_batches: int) -> float:
    """Batches/s arriving from W real DataLoader workers (aux rows not read: that is the pin thread's)."""
    plan = loader.plan(0)
    refs = plan.refs_of_rank[0][:plan.bounds_of_rank[0][plan.num_batches]]
    loc = np.stack([loader.index.store_of[refs], loader.index.shard_of[refs], loader.index.row_of[refs]])
    got, t0 = 0, None
    while got < num_batches + 1:  # cycle through the (small) store; the first batch warms up
        stream = ShardStream(loader.stores, loader.config, loc_3B=loc, bounds=plan.bounds_of_rank[0],
                             num_batches=plan.num_batches, start=0, epoch=0,
                             target_to_draft_V=loader.target_to_draft_V)
        for _ in DataLoader(stream, batch_size=None, num_workers=workers, prefetch_factor=2):
            got += 1
            if got == 1:
                t0 = time.perf_counter()
            if got == num_batches + 1:
                break
    return round(num_batches / (time.perf_counter() - t0), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp/peagle-bench", help="where the synthetic stores live (reused)")
    parser.add_argument("--json", default=None, help="write results here (default: stdout only)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--segments", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--attention", nargs="+", default=["flex", "sdpa"])
    parser.add_argument("--samples", type=int, default=0,
                        help="samples per store (default: ~400 MB per store: 8 at L=2048, 2 at L=8192)")
    parser.add_argument("--batches", type=int, default=6, help="timed batches per configuration")
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2], help="DataLoader runs with W workers")
    parser.add_argument("--hidden-dtype", nargs="+", default=["bf16"], choices=S.HIDDEN_DTYPES,
                        help="store encodings to measure (one store each)")
    parser.add_argument("--content-checks", nargs="+", default=["on", "off"], choices=["on", "off"],
                        help="time the loader with the per-file content checks (on: as `peagle train` runs), "
                        "without (off: the store's files read by size only), or both, in turns")
    parser.add_argument("--repeats", type=int, default=3,
                        help="loader timings per (W, content checks); the median is reported")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a DataLoader worker runs with one thread

    results = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                           "load_average_at_start": os.getloadavg()},
               "bytes_per_token": {d: raw_bytes_per_token(settings_for(2, hidden_dtype=d)) for d in args.hidden_dtype},
               "num_depths": 8, "configs": []}
    for seq_len in args.lengths:
        roots, vocabs, gib = {}, {}, {}
        for hidden_dtype in args.hidden_dtype:
            num_samples = args.samples or max(2, 16384 // seq_len)
            root = Path(args.out) / (f"store-L{seq_len}" + ("" if hidden_dtype == S.HIDDEN_BF16 else f"-{hidden_dtype}"))
            build_store(root, seq_len, num_samples, samples_per_shard=max(1, 4096 // seq_len * 2),
                        hidden_dtype=hidden_dtype)
            gib[hidden_dtype] = sum(p.stat().st_size for p in (root / S.SHARDS_DIR).iterdir()) / 2**30
            t0 = time.perf_counter()
            build_draft_vocab(root, DRAFT_VOCAB)
            vocab_s = time.perf_counter() - t0
            roots[hidden_dtype], vocabs[hidden_dtype] = root, load_draft_vocab(root, DRAFT_VOCAB)
            if "off" in args.content_checks:
                roots[(hidden_dtype, "off")] = unchecked_twin(root)
            print(f"L={seq_len}: store {root} ({num_samples} samples, {gib[hidden_dtype]:.2f} GiB); `peagle vocab` "
                  f"{vocab_s:.2f} s", flush=True)
        for segments in args.segments:
            for attention in args.attention:
                # Encodings measured in turns, batch by batch: on a shared machine both see the same load.
                loaders = {d: TrainLoader(loader_config(roots[d], seq_len, segments, attention), vocab=vocabs[d])
                           for d in args.hidden_dtype}
                measured: dict[str, list[dict]] = {d: [] for d in args.hidden_dtype}
                buffers: dict[str, dict] = {d: {} for d in args.hidden_dtype}
                for b in range(args.batches):
                    for d in args.hidden_dtype:
                        measured[d].append(measure_batch(loaders[d], roots[d], b, buffers[d]))
                recs = {d: {"seq_len": seq_len, "hidden_dtype": d, "segments": segments, "attention": attention,
                            "store_gib": round(gib[d], 3), **summarize(measured[d], seq_len),
                            **crc32_gib_per_s(roots[d])} for d in args.hidden_dtype}
                for w in args.workers:
                    for d in args.hidden_dtype:
                        recs[d][f"dataloader_batches_per_s_w{w}"] = time_dataloader(loaders[d], w, args.batches)
                    for d in args.hidden_dtype:
                        # checked and unchecked in turns, so that both see the same load on a shared machine
                        timed: dict[str, list[float]] = {mode: [] for mode in args.content_checks}
                        for _ in range(args.repeats):
                            for mode in args.content_checks:
                                root = roots[d] if mode == "on" else roots[(d, "off")]
                                timed[mode].append(time_loader(loader_config(root, seq_len, segments, attention,
                                                                             workers=w), vocabs[d], args.batches))
                        for mode, rates in timed.items():
                            key = f"loader_items_per_s_w{w}" + ("" if mode == "on" else "_unchecked")
                            recs[d][key] = statistics.median(rates)
                            recs[d][key + "_runs"] = rates
                        if len(timed) == 2:
                            on, off = recs[d][f"loader_items_per_s_w{w}"], recs[d][f"loader_items_per_s_w{w}_unchecked"]
                            recs[d][f"content_check_cost_w{w}"] = round(1 - on / off, 4)
                if S.HIDDEN_FP8 in roots:  # CPU training: the worker reads and dequantises the rows itself
                    cpu = TrainLoader(loader_config(roots[S.HIDDEN_FP8], seq_len, segments, attention,
                                                    dequantize_in_workers=True), vocab=vocabs[S.HIDDEN_FP8])
                    recs[S.HIDDEN_FP8]["cpu_path_build_ms"] = time_cpu_builds(cpu, args.batches)
                for rec in recs.values():
                    if seq_len == 8192 and args.workers:
                        for name, step_ms in REFERENCE_STEP_MS.items():
                            need = max(1, math.ceil(rec["worker_ms_per_batch"] / step_ms))
                            rec[f"workers_needed_{name}"] = need
                            rec[f"recommended_workers_{name}"] = need + 1
                            rec[f"pin_thread_share_of_step_{name}"] = round(rec["aux_read_cold_ms"] / step_ms, 3)
                    results["configs"].append(rec)
                    print(json.dumps(rec), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
