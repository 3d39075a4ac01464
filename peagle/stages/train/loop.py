"""The trainer: named verbs over one training run (after torchtitan's trainer, with nanoGPT's readability).

``run_training(config)`` = build, train, close. Each step takes ``grad_accum`` micro-batches from the
loader (time spent waiting is the *data-wait share*) and hands them to the step (step.py: the global
count, the units' forward+backward, clip, optimizer, schedule); the trainer keeps the run's state (step,
tokens seen, the logging window, checkpoints).

World size 1 is the same code: torch.distributed starts only when ``WORLD_SIZE > 1`` (gloo on CPU,
nccl on CUDA). Metrics are sums over a logging window (metrics_window.py), read once per logged step.

The run owns its directory for its whole life (``RUN_DIR/.lock``, run_dir.py: a second run into the
same --out is refused) and resumes from its newest valid checkpoint. A step whose loss or gradient
norm is not finite is not applied (step.py); more than --max-bad-steps of them stop the run, after a
checkpoint of the last good weights (bad_steps.py).
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from peagle.model.draft import PEagleDraft, build_draft_from_target
from peagle.model.finite import refuse_non_finite_export
from peagle.model.speculators_format import load_weights_into
from peagle.model.target.directory import check_store_matches_target, open_target
from peagle.pipeline.atomic import atomic_write_json
from peagle.pipeline.failpoints import failpoint
from peagle.pipeline.progress import Progress
from peagle.pipeline.provenance import provenance
from peagle.pipeline.store import read_settings
from peagle.pipeline.tracking.preflight import plan_tracking
from peagle.pipeline.tracking.scalars import describe_stores
from peagle.pipeline.tracking.tracker import Tracker, open_tracker
from peagle.schemas.checkpoint import (CHECKPOINTS_DIR, DRAFT_CONFIG_KEY, PROVENANCE_KEY, TRAIN_CONFIG_KEY,
                                       step_dir_name)
from peagle.schemas.draft_config import METHOD_NAMES, DraftConfig
from peagle.schemas.errors import UserError
from peagle.schemas.loader_config import stream_config
from peagle.schemas.secrets import redact
from peagle.schemas.train_config import TrainConfig, parse_store_spec
from peagle.stages.train import checkpoint as ckpt
from peagle.stages.train import follow
from peagle.stages.train.attention import resolve_attention
from peagle.stages.train.bad_steps import BadSteps
from peagle.stages.train.device import DevicePrefetcher
from peagle.stages.train.loader import TrainLoader
from peagle.stages.train.mask_token import resolve_mask_token_id
from peagle.stages.train.metrics_file import append_metrics, truncate_metrics
from peagle.stages.train.metrics_window import MetricsWindow
from peagle.stages.train.run_dir import RunLock, find_resume_point, lock_run_dir
from peagle.stages.train.step import StepResult, TrainStep, all_reduce_stats, init_distributed, summarise
from peagle.stages.train.train_batch import TrainBatch
from peagle.stages.train.vocab import check_same_vocab, checkpoint_draft_vocab, choose_draft_vocab_size, load_draft_vocab

RUN_FILE = "run.json"
DEFAULT_DRAFT_VOCAB = 32000


class Trainer:
    """Owns one run's state: model, optimizer, scheduler, loaders, step and tokens seen."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.run_dir = Path(config.out)
        self.step, self.tokens_seen = 0, 0
        self.loader: TrainLoader | None = None  # None in trainers that tests feed (peagle.testing.trainer)
        self.eval_loader: TrainLoader | None = None
        self.cpu_group = None
        self.checkpointer = ckpt.Checkpointer(self.run_dir, keep=config.checkpoint.keep_checkpoints)
        self.extra: dict[str, Any] = {}  # what the config part records besides the configs
        self.lr_used, self.data_wait_s = 0.0, 0.0
        # None: the device's default (device.default_compute_dtype); tests may set it too
        self.compute_dtype: torch.dtype | None = (None if config.compute_dtype == "auto"
                                                  else getattr(torch, config.compute_dtype))
        self.roots = [Path(spec.path) for spec in config.data.stores()]
        self.epoch_began_at: dict[int, int] = {}  # with --follow/--epoch-shards: the step each epoch began at
        self.run_lock: RunLock | None = None  # rank 0's, from build() to close()
        self.bad_steps = BadSteps(self.run_dir, max_bad_steps=config.max_bad_steps)
        self.tracker: Tracker | None = None  # rank 0's experiment trackers (--logger), from build() to close()

    # ---------------------------------------------------------------------------------------- build

    def build(self) -> None:
        """Process group, stores, vocab, draft, wrapper, optimizer, schedule; then resume if possible."""
        c, data = self.config, self.config.data
        ckpt.seed_rngs(c.seed)  # before anything draws; a resume then restores the checkpoint's states
        self.setup_world()
        self.run_lock = lock_run_dir(self.run_dir, rank=self.rank, agree=self._agree)
        resume_from = find_resume_point(self.run_dir, c, rank=self.rank, world_size=self.world_size)
        tracking = self._on_rank0(lambda: plan_tracking(  # before any slow work: a tracker that cannot run is one line
            c, log_dir=self.run_dir / "logs", run_name=self.run_dir.resolve().name,
            mlflow_default=f"file:{(self.run_dir / 'mlruns').resolve()}"))
        if data.follow:  # extraction may not have committed anything yet
            follow.wait_for_first_commit(self.roots, timeout_s=data.follow_timeout, say=self._say)
        target = open_target(c.target)
        target_cfg = target.config
        for path in [s.path for s in data.stores()] + ([parse_store_spec(data.eval_store).path] if data.eval_store else []):
            check_store_matches_target(read_settings(path), target, store=path)
        first_store = data.stores()[0].path
        settings = read_settings(first_store)
        vocab_size = int(target_cfg.vocab_size)
        draft_vocab_size, note = choose_draft_vocab_size(
            first_store, c.draft_vocab_size or checkpoint_draft_vocab(resume_from)[0], vocab_size, DEFAULT_DRAFT_VOCAB)
        if note:
            self._say(note)
        if draft_vocab_size > vocab_size:
            raise UserError(f"--draft-vocab-size {draft_vocab_size} is larger than the target vocab {vocab_size}")
        vocab = None if draft_vocab_size == vocab_size else load_draft_vocab(first_store, draft_vocab_size,
                                                                              growing=data.follow, say=self._say)
        source = follow.epoch_source(self.roots, follow=data.follow, epoch_shards=data.epoch_shards,
                                     timeout_s=data.follow_timeout, say=self._say)
        self.loader = TrainLoader(stream_config(c, aux_layer_ids=settings.aux_layer_ids, attention=self.attention,
                                                on_cuda=self.device.type == "cuda", eval_split=False), vocab=vocab,
                                  rank=self.rank, world_size=self.world_size, source=source, agree=self._agree,
                                  on_epoch=self._record_epoch)
        # --epochs (default 1) becomes a step count once, from epoch 0's plan: resume-safe and exact.
        epochs = c.epochs if c.epochs is not None else 1.0
        total_steps = c.max_steps or max(1, int(epochs * self.loader.num_batches) // c.grad_accum)

        # The mask token is a fact of the store (extract chose it) that a P-EAGLE draft config carries on;
        # an EAGLE-3 draft has no mask slots.
        mask_token_id = resolve_mask_token_id(self.loader.stores, c.mask_token_id) if c.method == "peagle" else None
        self.draft_config = DraftConfig.from_target_config(
            target_cfg, num_layers=c.num_layers, draft_vocab_size=draft_vocab_size, mask_token_id=mask_token_id,
            aux_layer_ids=list(settings.aux_layer_ids), method=c.method,
            architecture=c.draft_architecture, norm_before_residual=c.norm_before_residual,
            norm_before_fc=c.norm_before_fc, fc_norm=c.fc_norm)
        torch.manual_seed(c.seed)  # the same initial draft on every rank and in every run
        draft = build_draft_from_target(c.target, self.draft_config, None if vocab is None else vocab.selected_ids_N,
                                        train_lm_head=c.train_lm_head, train_embeddings=c.train_embeddings,
                                        activation_checkpointing=c.activation_checkpointing, device=self.device)
        if c.init_from:
            refuse_non_finite_export(c.init_from)
            self._say(load_weights_into(draft, c.init_from))
        self.build_step(draft, total_steps)
        ckpt.seed_rngs(ckpt.rank_seed(c.seed, self.rank))  # alike above, each rank its own draws from here
        self.extra = {"store_manifest_hash": self.loader.manifest_hashes[0],
                      "store_manifest_hashes": list(self.loader.manifest_hashes),
                      "draft_vocab": None if vocab is None else vocab.identity_record(),
                      PROVENANCE_KEY: provenance()}  # this process: the revision and host that train
        if resume_from is not None:
            check_same_vocab(checkpoint_draft_vocab(resume_from)[1], self.extra["draft_vocab"], first_store)
            self.load_state_dict(ckpt.load_checkpoint(resume_from))
            self._say(f"resumed from {resume_from} (step {self.step})")
            if source is not None:  # epochs the killed run began after its checkpoint begin again
                self._record_epoch(None, None)
        self.eval_loader = self._eval_loader(target_cfg, settings, vocab)
        if self.rank == 0:
            truncate_metrics(self.run_dir, self.step)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.run_dir / RUN_FILE, self._config_part())
        self.tracker = self._on_rank0(lambda: open_tracker(tracking, state_dir=self.run_dir, start=self.step, config=(
            c.to_dict()), extras={"stores": describe_stores(self.loader.stores, [s.weight for s in data.stores()],
                                                           self.loader.manifest_hashes)}))
        num_params = sum(p.numel() for p in self.draft.parameters())
        num_trainable = sum(p.numel() for p in self.draft.parameters() if p.requires_grad)
        self._say(f"draft ({METHOD_NAMES[c.method]}, K = {c.cod.num_depths}): {c.num_layers} layers, "
                  f"{num_params / 1e6:.1f}M params ({num_trainable / 1e6:.1f}M trainable), vocab {draft_vocab_size}; world {self.world_size} on {self.device.type}, "
                  f"{self.step_fn.describe()}; {self.loader.num_batches} batches/epoch/rank, {total_steps} steps")

    def _eval_loader(self, target_cfg: Any, settings: Any, vocab: Any) -> TrainLoader | None:
        """The evaluation stream; a followed store's held-out split is that of the first epoch's shards."""
        config = stream_config(self.config, aux_layer_ids=settings.aux_layer_ids, attention=self.attention,
                               on_cuda=self.device.type == "cuda", eval_split=True)
        if config is None or self.config.eval_every == 0:
            return None
        source = None
        if self.loader.source is not None and self.config.data.eval_store is None:
            self.loader.plan(0)  # decides epoch 0 where no checkpoint recorded it
            first = self.loader.epoch_shards[0]
            source = lambda epoch, previous: first  # noqa: E731
        loader = TrainLoader(config, vocab=vocab, rank=self.rank, world_size=self.world_size, source=source,
                             agree=self._agree)
        if loader.plan(0).num_batches == 0:
            self._say("warning: the evaluation split holds no batch (raise --heldout-fraction or pass "
                      "--eval-store); evaluation is off")
            return None
        return loader

    def _on_rank0(self, work: Callable[[], Any]) -> Any:
        """``work()`` on rank 0, None elsewhere (the trackers: preflight, opening them); a UserError there
        ends every rank with its line instead of leaving the others at their next collective."""
        result, problem = None, None
        try:
            result = None if self.rank else work()
        except UserError as err:
            problem = str(err)
        problem = self._agree(problem)
        if problem:
            raise UserError(problem)
        return result

    def _agree(self, decided: Any) -> Any:
        """Rank 0's ``decided`` on every rank (the shards an epoch covers must be the same everywhere)."""
        if self.world_size == 1:
            return decided
        box = [decided]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def _record_epoch(self, epoch: int | None, shards: Any) -> None:
        """RUN_DIR/epochs.json: the shards of every epoch begun (``follow.py``); ``epoch`` None rewrites it
        from the loader's state (after a resume)."""
        if epoch is not None:
            self.epoch_began_at[epoch] = self.step
            if self.tracker is not None:  # --follow: each epoch shows as it begins, with how many shards it holds
                self.tracker.log(self.step, {"train/epoch_began": epoch, "train/epoch_shards": sum(map(len, shards.shards))})
        if self.rank == 0:
            began = {e: s for e, s in self.epoch_began_at.items() if e in self.loader.epoch_shards}
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.run_dir / follow.EPOCHS_FILE,
                              follow.epochs_record(self.roots, self.loader.epoch_shards, began))

    def setup_world(self) -> None:
        """The process group (under torchrun), this rank's device and the resolved attention."""
        self.rank, self.world_size, self.device = init_distributed()
        self.bad_steps.rank = self.rank
        if self.world_size > 1:  # counts live on the CPU: reducing them over gloo never waits for the GPU
            self.cpu_group = dist.new_group(backend="gloo") if self.device.type == "cuda" else dist.group.WORLD
        self.attention = resolve_attention(self.config.attention, self.device)

    def build_step(self, draft: PEagleDraft, total_steps: int) -> None:
        """The step: device placement, the DDP/FSDP2 wrapper, flex compile, AdamW, the LR schedule."""
        self.draft_config = draft.config
        self.total_steps = total_steps
        self.step_fn = TrainStep(draft, self.config, device=self.device, attention=self.attention,
                                 total_steps=total_steps, world_size=self.world_size, cpu_group=self.cpu_group,
                                 compute_dtype=self.compute_dtype)
        self.window = MetricsWindow(self.config.cod.num_depths, self.device)

    @property
    def draft(self) -> PEagleDraft:
        return self.step_fn.draft

    # ---------------------------------------------------------------------------------------- the loop

    def batch_generator(self) -> Iterator[list[TrainBatch]]:
        """Each step's micro-batches from the loader's endless stream; the wait is timed."""
        stream = self.loader.stream()
        while True:
            start = time.perf_counter()
            micro_batches = [next(stream) for _ in range(self.config.grad_accum)]
            self.data_wait_s += time.perf_counter() - start
            yield micro_batches

    def train_step(self, micro_batches: list[TrainBatch]) -> StepResult:
        """One optimizer step (step.py), added to the logging window; a step that was not applied is
        counted and its samples recorded instead (bad_steps.py)."""
        failpoint("train.step")
        result = self.step_fn(micro_batches)
        self.step += 1
        self.tokens_seen += int(result.num_tokens)
        self.lr_used = result.lr
        if result.applied:
            self.window.add(result, all_reduce_stats(result.stats) if self.world_size > 1 else result.stats)
        else:
            self._say(self.bad_steps.record(self.step, micro_batches, cpu_group=self.cpu_group))
            self.window.add_bad_step()
        return result

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any] | None:
        """Loss, per-depth agreement, AL estimate and ``num_no_target`` on the evaluation stream (the same
        batches and COD draws each time, so evaluations compare)."""
        if self.eval_loader is None:
            return None
        stats, no_target = self.step_fn.evaluate(self.eval_loader.batches(epoch=0))
        return {"kind": "eval", "step": self.step, **summarise(stats), "num_no_target": no_target}

    def train(self) -> None:
        """Steps until ``total_steps``, logging, evaluating and checkpointing on the way."""
        c = self.config
        if self.step >= self.total_steps:
            self._say(f"{self.run_dir} is already trained to step {self.step}; nothing to do")
            return
        bar = None
        if self.rank == 0:
            bar = Progress(self.total_steps, initial=self.step, desc="train", unit="step")
        batches = DevicePrefetcher(self.batch_generator(), self.device)  # CUDA: copies beside the step
        self.data_wait_s, window_start = 0.0, time.perf_counter()
        while self.step < self.total_steps:
            micro_batches = next(batches)
            try:
                result = self.train_step(micro_batches)
            except torch.OutOfMemoryError as err:
                raise UserError(f"out of {self.device.type} memory in step {self.step + 1} (micro-batches of "
                                f"{max(b.num_elements for b in micro_batches)} COD elements): lower --token-budget, "
                                "raise --sequence-partitions or turn on --activation-checkpointing") from err
            if not result.applied and self.bad_steps.over_budget:  # the weights are the last good ones: keep them
                self.save()
                raise self.bad_steps.stop_error(self.run_dir / CHECKPOINTS_DIR / step_dir_name(self.step))
            last = self.step == self.total_steps
            if self.step % c.log_every == 0 or last:  # the one host read of the window's device sums
                record = {**self.window_metrics(time.perf_counter() - window_start), "epoch": self.loader.epoch}
                self._write_metrics(record)
                if bar is not None:
                    agree = "/".join("-" if a is None else f"{a:.2f}" for a in record["depth_agreement"][:4])
                    loss = "-" if record["loss"] is None else f"{record['loss']:.4f}"
                    bar.set_postfix(f"loss {loss} agree {agree}")
                self.data_wait_s, window_start = 0.0, time.perf_counter()
            if bar is not None:
                bar.update(1)
            paused = time.perf_counter()  # evals and saves are not training: kept out of the window's tokens/s
            if c.eval_every and (self.step % c.eval_every == 0 or last) and self.eval_loader is not None:
                self._write_metrics(self.evaluate())
            if (c.checkpoint.save_every and self.step % c.checkpoint.save_every == 0) or last:
                self.save()
            window_start += time.perf_counter() - paused
        if bar is not None:
            bar.close()
        if c.data.follow:  # the steps are spent: is the store complete, was every shard trained on?
            now = self._agree(follow.snapshot(self.roots) if self.rank == 0 else None)
            for line in follow.end_of_follow(now, self.roots, self.loader.epoch_shards, max_steps=self.total_steps,
                                             allow_incomplete=c.data.allow_incomplete):
                self._say(line)

    def window_metrics(self, seconds: float) -> dict[str, Any]:
        """The metrics of the steps since the last call (one metrics.jsonl line); resets the window."""
        return self.window.record(step=self.step, lr=self.lr_used, tokens_seen=self.tokens_seen, seconds=seconds,
                                  data_wait_s=self.data_wait_s)

    # ---------------------------------------------------------------------------------------- state

    def save(self) -> None:
        """A checkpoint, then the trackers' queue written out: a resume from it hides TensorBoard's events
        past its step, so the ones up to it must be on disk."""
        self.checkpointer.save(self.step, self.state_dict())
        if self.tracker is not None:
            self.tracker.flush()

    def state_dict(self) -> dict[str, Any]:
        """Every Stateful part under the checkpoint's constant keys; the model is the unwrapped draft."""
        return {
            **ckpt.model_and_optimizer_state(self.draft, self.step_fn.optimizer),
            ckpt.LR_SCHEDULER: self.step_fn.scheduler.state_dict(),
            ckpt.TRAIN_STATE: {"step": self.step, "tokens_seen": self.tokens_seen, "window": self.window.state_dict(),
                               "epoch_began_at": {str(e): s for e, s in self.epoch_began_at.items()},
                               "bad_steps": self.bad_steps.count},
            ckpt.CONFIG: self._config_part(),
            ckpt.DATALOADER: self.loader.state_dict() if self.loader is not None else {},
            ckpt.RNG: ckpt.rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ckpt.load_model_and_optimizer(self.draft, self.step_fn.optimizer, state)
        self.step_fn.scheduler.load_state_dict(state[ckpt.LR_SCHEDULER])
        train_state = state[ckpt.TRAIN_STATE]
        self.step, self.tokens_seen = int(train_state["step"]), int(train_state["tokens_seen"])
        self.epoch_began_at = {int(e): int(s) for e, s in train_state.get("epoch_began_at", {}).items()}
        self.bad_steps.resume(self.step, int(train_state.get("bad_steps", 0)))
        # The logging window in flight at the checkpoint: the next metrics line covers the same steps.
        warning = self.window.load_state_dict(train_state["window"])
        if warning:
            self._say(warning)
        if self.loader is not None:
            self.loader.load_state_dict(state[ckpt.DATALOADER])
        ckpt.set_rng_state(state[ckpt.RNG])

    def close(self, *, finished: bool = False) -> None:
        """Tear the process group down. After a finished run the ranks first meet at a barrier, so every
        rank is past its last collective before any rank leaves (a peer that leaves early fails a collective
        still waiting on it); after a failure there is no barrier, since a peer may never come."""
        if dist.is_available() and dist.is_initialized():
            if finished:
                dist.barrier()
            # Free what holds the process group (the DDP/FSDP wrapper and its hooks' reference cycles,
            # the CPU group) while the interpreter is whole, so gloo's threads stop now: left to
            # interpreter shutdown, gloo's teardown aborted a rank (std::terminate in a gloo thread,
            # then SIGSEGV) in about one in three CPU torchrun runs that followed the compile tests.
            self.step_fn = self.cpu_group = None
            gc.collect()
            dist.destroy_process_group()
        if self.tracker is not None:
            self.tracker.close(failed=not finished)
            self.tracker = None
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None

    # ---------------------------------------------------------------------------------------- helpers

    def _write_metrics(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            append_metrics(self.run_dir, record)
            if self.tracker is not None:  # queued: the trackers' thread sends it (tracker.py)
                self.tracker.log_record(record)

    def _config_part(self) -> dict[str, Any]:
        """What export and resume read: the run config (credentials redacted: a tracking URI's stay in
        the process, schemas/secrets.py), the draft config, the stores trained on and the provenance of
        the training process."""
        return {TRAIN_CONFIG_KEY: redact(self.config.to_dict()), DRAFT_CONFIG_KEY: self.draft_config.to_dict(),
                "world_size": self.world_size, **self.extra}

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(f"peagle: {line}", file=sys.stderr, flush=True)


def run_training(config: TrainConfig) -> None:
    """``peagle train``: build, train, close (every rank runs this)."""
    logging.basicConfig(level=logging.INFO, format="peagle: %(message)s")
    trainer = Trainer(config)
    finished = False
    try:
        trainer.build()
        trainer.train()
        finished = True
    finally:
        trainer.close(finished=finished)
