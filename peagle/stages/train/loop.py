"""The trainer: named verbs over one training run (STYLE: torchtitan's trainer, nanoGPT's readability).

``run_training(config)`` = build, train, close. One optimizer step (``train_step``):

1. take ``grad_accum`` micro-batches from the loader (time spent waiting is the *data-wait share*);
2. sum their supervised counts and all-reduce it: ONE global count for the step (DESIGN §5), known
   before any backward, so every unit charges ``loss_sum · world / count`` (DDP/FSDP average
   gradients over ranks; the factor ``world`` undoes that) and nothing is averaged per micro-batch;
3. one forward+backward per (micro-batch, segment) unit (``forward_backward_step``, step.py);
   gradients sync only in the last unit's backward (DDP ``no_sync`` / FSDP2 gradient-sync flag);
4. clip, AdamW (fp32 master weights; bf16 autocast on CUDA), LR schedule (warmup, cosine).

World size 1 is the same code: torch.distributed starts only when ``WORLD_SIZE > 1`` (gloo on CPU,
nccl on CUDA). The per-step counts are reduced over a gloo group on the CPU: no host-GPU sync.
Metrics are sums over a logging window, kept on the device and read once per logged step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from peagle.model.draft import PEagleDraft, build_draft_from_target
from peagle.pipeline.atomic import atomic_write_bytes, atomic_write_json
from peagle.pipeline.checkpoint_files import latest_valid_checkpoint, read_checkpoint_part
from peagle.pipeline.failpoints import failpoint
from peagle.pipeline.progress import Progress
from peagle.pipeline.store import read_settings
from peagle.pipeline.target_identity import target_content_hash
from peagle.schemas.checkpoint import DRAFT_CONFIG_KEY, TRAIN_CONFIG_KEY
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.errors import UserError
from peagle.schemas.train_config import TrainConfig, config_mismatch, parse_store_spec
from peagle.stages.train import checkpoint as ckpt
from peagle.stages.train.batch import CodSettings, TrainBatch
from peagle.stages.train.loader import LoaderConfig, TrainLoader
from peagle.stages.train.step import (DraftStep, Unit, build_optimizer, lr_factor, stats_vector, summarise,
                                      to_units, unit_forward)
from peagle.stages.train.vocab import load_draft_vocab

METRICS_FILE = "metrics.jsonl"
RUN_FILE = "run.json"
DEFAULT_DRAFT_VOCAB = 32000


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device) from torchrun's environment; a process group only when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return (dist.get_rank() if world > 1 else 0), world, device


def resolve_attention(attention: str, device: torch.device) -> str:
    """``auto`` is flex on CUDA and sdpa elsewhere; flex training off CUDA is refused (no CPU backward)."""
    if attention == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if attention == "flex" and device.type != "cuda":
        raise UserError("--attention flex needs a CUDA device for training (flex_attention has no CPU "
                        "backward); use --attention sdpa or auto on CPU")
    return attention


class Trainer:
    """Owns one run's state: model, optimizer, scheduler, loaders, step and tokens seen."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.run_dir = Path(config.out)
        self.step, self.tokens_seen = 0, 0
        self.loader: TrainLoader | None = None  # None in trainers made by ``for_model``
        self.eval_loader: TrainLoader | None = None
        self.cpu_group = None
        self.extra: dict[str, Any] = {}
        self.lr_used, self.data_wait_s = 0.0, 0.0

    # ---------------------------------------------------------------------------------------- build

    def build(self) -> None:
        """Process group, stores, vocab, draft, wrapper, optimizer, schedule; then resume if possible."""
        c = self.config
        ckpt.seed_rngs(c.seed)  # before anything draws; a resume then restores the checkpoint's states
        self._setup_world()
        resume_from = self._find_resume_point()
        target_cfg = _load_target_config(c.target)
        first_store = c.stores()[0].path
        settings = read_settings(first_store)
        _check_store_matches_target(settings, target_cfg, first_store, c.target)
        vocab_size = int(target_cfg.vocab_size)
        draft_vocab_size = c.draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, vocab_size)
        if draft_vocab_size > vocab_size:
            raise UserError(f"--draft-vocab-size {draft_vocab_size} is larger than the target vocab {vocab_size}")
        vocab = None if draft_vocab_size == vocab_size else load_draft_vocab(first_store, draft_vocab_size)

        self.loader = TrainLoader(self._loader_config(target_cfg, settings, eval_split=False), vocab=vocab,
                                  rank=self.rank, world_size=self.world_size)
        eval_config = self._loader_config(target_cfg, settings, eval_split=True)
        if eval_config is not None and c.eval_every > 0:
            self.eval_loader = TrainLoader(eval_config, vocab=vocab, rank=self.rank, world_size=self.world_size)
            if self.eval_loader.plan(0).num_batches == 0:
                self._say("warning: the evaluation split holds no batch (raise --heldout-fraction or pass "
                          "--eval-store); evaluation is off")
                self.eval_loader = None
        # --epochs (default 1) becomes a step count once, from epoch 0's plan: resume-safe and exact.
        epochs = c.epochs if c.epochs is not None else 1.0
        total_steps = c.max_steps or max(1, int(epochs * self.loader.num_batches) // c.grad_accum)

        self.draft_config = DraftConfig.from_target_config(
            target_cfg, num_layers=c.num_layers, draft_vocab_size=draft_vocab_size,
            mask_token_id=self.loader.mask_token_id, aux_layer_ids=list(settings.aux_layer_ids))
        torch.manual_seed(c.seed)  # the same initial draft on every rank and in every run
        draft = build_draft_from_target(c.target, self.draft_config, None if vocab is None else vocab.selected_ids_N,
                                        train_lm_head=c.train_lm_head,
                                        activation_checkpointing=c.activation_checkpointing)
        if c.init_from:
            self._say(ckpt.load_warm_start(draft, c.init_from))
        self._build_optimization(draft, total_steps)
        self.extra = {"store_manifest_hash": self.loader.manifest_hashes[0],
                      "store_manifest_hashes": list(self.loader.manifest_hashes)}
        if resume_from is not None:
            self.load_state_dict(ckpt.load_checkpoint(resume_from))
            self._say(f"resumed from {resume_from} (step {self.step})")
        if self.rank == 0:
            self._truncate_metrics(self.step)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.run_dir / RUN_FILE, self._config_part())
        num_params = sum(p.numel() for p in self.draft.parameters())
        num_trainable = sum(p.numel() for p in self.draft.parameters() if p.requires_grad)
        self._say(f"draft: {c.num_layers} layers, {num_params / 1e6:.1f}M params ({num_trainable / 1e6:.1f}M "
                  f"trainable), vocab {draft_vocab_size}; world {self.world_size} on {self.device.type}, "
                  f"attention {self.attention}; {self.loader.num_batches} batches/epoch/rank, {total_steps} steps")

    @classmethod
    def for_model(cls, config: TrainConfig, draft: PEagleDraft) -> "Trainer":
        """A trainer around a given draft, without stores or checkpoints (tests and benchmarks feed
        their own batches to ``train_step`` / ``accumulate_gradients``); the config's paths are unused."""
        self = cls(config)
        self._setup_world()
        self.draft_config = draft.config
        self._build_optimization(draft, config.max_steps or 1)
        return self

    def _setup_world(self) -> None:
        self.rank, self.world_size, self.device = init_distributed()
        if self.world_size > 1:  # counts live on the CPU: reducing them over gloo never waits for the GPU
            self.cpu_group = dist.new_group(backend="gloo") if self.device.type == "cuda" else dist.group.WORLD
        self.attention = resolve_attention(self.config.attention, self.device)

    def _build_optimization(self, draft: PEagleDraft, total_steps: int) -> None:
        """Device placement, the DDP/FSDP2 wrapper, AdamW and the LR schedule."""
        c = self.config
        self.total_steps = total_steps
        self.draft = draft.to(self.device)
        self.model = self._parallelize(DraftStep(self.draft))
        self.optimizer = build_optimizer(self.draft, c, self.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, c.warmup_steps, total_steps))
        self._reset_window()

    def _parallelize(self, module: DraftStep) -> nn.Module:
        if self.world_size == 1:
            return module
        if self.config.fsdp:  # FSDP2: one unit per decoder layer, the rest (embeddings, heads) in the root
            from torch.distributed.fsdp import fully_shard

            for layer in module.draft.layers:
                fully_shard(layer)
            return fully_shard(module)
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def _loader_config(self, target_cfg: Any, settings: Any, *, eval_split: bool) -> LoaderConfig | None:
        """The training stream, or the evaluation stream (eval store, else the held-out split; None if neither)."""
        c = self.config
        stores, split, fraction = c.stores(), "train", c.heldout_fraction
        if c.eval_store is not None:
            stores, split, fraction = ([parse_store_spec(c.eval_store)] if eval_split else stores), "all", 0.0
        elif eval_split:
            if c.heldout_fraction == 0:
                return None
            split = "heldout"
        return LoaderConfig(
            stores=tuple(stores), seed=c.seed, token_budget=c.token_budget,
            cod=CodSettings(num_depths=c.num_depths, down_sample_ratio=c.down_sample_ratio,
                            down_sample_ratio_min=c.down_sample_ratio_min, max_anchors=c.max_anchors),
            split=split, heldout_fraction=fraction, shuffle=not eval_split,
            sequence_partitions=c.sequence_partitions, attention=self.attention,
            num_workers=0 if eval_split else c.num_workers, pin_memory=self.device.type == "cuda",
            verify=c.verify, hidden_size=int(target_cfg.hidden_size), target_vocab_size=int(target_cfg.vocab_size),
            aux_layer_ids=tuple(settings.aux_layer_ids))

    def _find_resume_point(self) -> Path | None:
        """Rank 0 picks the newest valid checkpoint (warning about damaged ones) and checks its config."""
        found: list[Any] = [None]
        if self.rank == 0:
            path = latest_valid_checkpoint(self.run_dir)
            if path is not None:
                saved = read_checkpoint_part(path, ckpt.CONFIG)[TRAIN_CONFIG_KEY]
                found = [(str(path), config_mismatch(saved, self.config))]
        if self.world_size > 1:
            dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            return None
        path, problem = found[0]
        if problem:
            raise UserError(f"cannot resume {self.run_dir}: {problem}")
        return Path(path)

    # ---------------------------------------------------------------------------------------- the loop

    def batch_generator(self) -> Iterator[list[TrainBatch]]:
        """Each step's micro-batches from the loader's endless stream; the wait is timed."""
        stream = self.loader.stream()
        while True:
            start = time.perf_counter()
            micro_batches = [next(stream) for _ in range(self.config.grad_accum)]
            self.data_wait_s += time.perf_counter() - start
            yield micro_batches

    def forward_backward_step(self, unit: Unit, loss_scale: float, *, backward: bool = True) -> Tensor:
        """Forward one unit, backward ``loss_sum · loss_scale``; returns its detached stats vector."""
        stats = unit_forward(self.model, unit, attention=self.attention, num_depths=self.config.num_depths,
                             device=self.device)
        if backward:
            (stats.loss_sum * loss_scale).backward()
        return stats_vector(stats)

    def accumulate_gradients(self, micro_batches: list[TrainBatch]) -> tuple[Tensor, float, float, float]:
        """Steps 2-3 (module docstring): one global count, then every unit's forward+backward.

        Returns this rank's summed stats vector and the global (supervised, tokens, no-target) counts.
        """
        counts = torch.tensor([sum(b.num_supervised for b in micro_batches), sum(b.num_tokens for b in micro_batches),
                               sum(b.num_no_target for b in micro_batches)], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(counts, group=self.cpu_group)  # BEFORE any backward: every unit's divisor
        global_count, num_tokens, num_no_target = (float(x) for x in counts)
        loss_scale = self.world_size / max(global_count, 1.0)
        units = [unit for batch in micro_batches for unit in to_units(batch, self.device)]
        stats = torch.zeros(2 + 3 * self.config.num_depths, device=self.device)
        for i, unit in enumerate(units):
            with self._gradient_sync(i == len(units) - 1):
                stats += self.forward_backward_step(unit, loss_scale)
        return stats, global_count, num_tokens, num_no_target

    def train_step(self, micro_batches: list[TrainBatch]) -> None:
        """One optimizer step over this rank's micro-batches (module docstring, steps 2-4)."""
        failpoint("train.step")
        self.optimizer.zero_grad(set_to_none=True)
        stats, global_count, num_tokens, num_no_target = self.accumulate_gradients(micro_batches)
        if self.config.grad_clip > 0:
            params = [p for p in self.draft.parameters() if p.requires_grad]
            self.window["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip).detach()
        self.optimizer.step()
        self.lr_used = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.step += 1
        self.tokens_seen += int(num_tokens)
        if self.world_size > 1:
            dist.all_reduce(stats)  # a few floats; asynchronous for the host on a GPU
        self.window["stats"] += stats
        self.window["tokens"] += num_tokens
        self.window["no_target"] += num_no_target

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any] | None:
        """Loss, per-depth agreement and the AL estimate on the evaluation stream (the same batches,
        the same COD draws each time, so evaluations compare across steps)."""
        if self.eval_loader is None:
            return None
        self.model.eval()
        stats = torch.zeros(2 + 3 * self.config.num_depths, device=self.device)
        for batch in self.eval_loader.batches(epoch=0):
            for unit in to_units(batch, self.device):
                stats += self.forward_backward_step(unit, 0.0, backward=False)
        self.model.train()
        if self.world_size > 1:
            dist.all_reduce(stats)
        return {"kind": "eval", "step": self.step, **summarise(stats, self.config.num_depths)}

    def train(self) -> None:
        """Steps until ``total_steps``, logging, evaluating and checkpointing on the way."""
        c = self.config
        if self.step >= self.total_steps:
            self._say(f"{self.run_dir} is already trained to step {self.step}; nothing to do")
            return
        bar = None
        if self.rank == 0:
            bar = Progress(self.total_steps, initial=self.step, desc="train", unit="step")
        self.model.train()
        batches = self.batch_generator()
        self.data_wait_s, window_start = 0.0, time.perf_counter()
        while self.step < self.total_steps:
            self.train_step(next(batches))
            last = self.step == self.total_steps
            if self.step % c.log_every == 0 or last:  # the one host read of the window's device sums
                record = {**self.window_metrics(time.perf_counter() - window_start), "epoch": self.loader.epoch}
                self._write_metrics(record)
                if bar is not None:
                    agree = "/".join("-" if a is None else f"{a:.2f}" for a in record["depth_agreement"][:4])
                    bar.set_postfix(f"loss {record['loss']:.4f} agree {agree}")
                self.data_wait_s, window_start = 0.0, time.perf_counter()
            if bar is not None:
                bar.update(1)
            if c.eval_every and (self.step % c.eval_every == 0 or last) and self.eval_loader is not None:
                self._write_metrics(self.evaluate())
            if (c.save_every and self.step % c.save_every == 0) or last:
                ckpt.save_checkpoint(self.run_dir, self.step, self.state_dict(), keep=c.keep_checkpoints)
        if bar is not None:
            bar.close()

    def window_metrics(self, seconds: float) -> dict[str, Any]:
        """The metrics of the steps since the last call (one metrics.jsonl line); resets the window."""
        w = self.window
        record = {"kind": "train", "step": self.step, **summarise(w["stats"], self.config.num_depths),
                  "lr": self.lr_used, "grad_norm": None if w["grad_norm"] is None else float(w["grad_norm"]),
                  "tokens_seen": self.tokens_seen, "num_no_target": int(w["no_target"]),
                  "tokens_per_s": w["tokens"] / max(seconds, 1e-9),
                  "data_wait_share": min(1.0, self.data_wait_s / max(seconds, 1e-9)), "step_time_s": seconds}
        self._reset_window()
        return record

    # ---------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Every Stateful part under the checkpoint's constant keys; the model is the unwrapped draft."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # FSDP2: gathered full tensors
        window = {k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in self.window.items() if v is not None}
        return {
            ckpt.MODEL: get_model_state_dict(self.draft, options=options),
            ckpt.OPTIMIZER: get_optimizer_state_dict(self.draft, self.optimizer, options=options),
            ckpt.LR_SCHEDULER: self.scheduler.state_dict(),
            ckpt.TRAIN_STATE: {"step": self.step, "tokens_seen": self.tokens_seen, "window": window},
            ckpt.CONFIG: self._config_part(),
            ckpt.DATALOADER: self.loader.state_dict() if self.loader is not None else {},
            ckpt.RNG: ckpt.rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.draft, state[ckpt.MODEL], options=options)
        set_optimizer_state_dict(self.draft, self.optimizer, state[ckpt.OPTIMIZER], options=options)
        self.scheduler.load_state_dict(state[ckpt.LR_SCHEDULER])
        train_state = state[ckpt.TRAIN_STATE]
        self.step, self.tokens_seen = int(train_state["step"]), int(train_state["tokens_seen"])
        # The logging window in flight at the checkpoint: the next metrics line covers the same steps.
        self.window.update({k: (v.to(self.device) if isinstance(v, Tensor) else v)
                            for k, v in train_state["window"].items()})
        if self.loader is not None:
            self.loader.load_state_dict(state[ckpt.DATALOADER])
        ckpt.set_rng_state(state[ckpt.RNG])

    def close(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    # ---------------------------------------------------------------------------------------- helpers

    def _gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Sync gradients only in the step's last backward (DDP ``no_sync`` / the FSDP2 flag)."""
        if self.world_size == 1:
            return contextlib.nullcontext()
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if sync else self.model.no_sync()

    def _reset_window(self) -> None:
        self.window = {"stats": torch.zeros(2 + 3 * self.config.num_depths, device=self.device), "tokens": 0.0,
                       "no_target": 0.0, "grad_norm": None}

    def _write_metrics(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            with open(self.run_dir / METRICS_FILE, "a") as f:
                f.write(json.dumps(record) + "\n")

    def _truncate_metrics(self, step: int) -> None:
        """Drop metrics lines past the resumed step (a killed run wrote them; this run writes them again)."""
        path = self.run_dir / METRICS_FILE
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError, AttributeError):
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line + "\n")
        atomic_write_bytes(path, "".join(kept).encode())

    def _config_part(self) -> dict[str, Any]:
        """What export and resume read: the run config, the draft config, store provenance."""
        return {TRAIN_CONFIG_KEY: self.config.to_dict(), DRAFT_CONFIG_KEY: self.draft_config.to_dict(),
                "world_size": self.world_size, **self.extra}

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(f"peagle: {line}", file=sys.stderr, flush=True)


def _load_target_config(target: str) -> Any:
    from transformers import AutoConfig

    if not (Path(target) / "config.json").is_file():
        raise UserError(f"--target {target} is not a model directory (no config.json)")
    config = AutoConfig.from_pretrained(target)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "architectures", None):
        text.architectures = getattr(config, "architectures", None)
    return text


def _check_store_matches_target(settings: Any, target_cfg: Any, store: str, target: str) -> None:
    """One line naming the first of architecture, hidden size, layers, vocab that differs, then the
    weights themselves (content hash: a same-shaped target with other weights) (DESIGN §2).

    The loader checks that every store has the first one's target; this checks the first against --target.
    """
    t = settings.target
    architecture = (getattr(target_cfg, "architectures", None) or [t.architecture])[0]
    for name, held, want in (("architecture", t.architecture, architecture),
                             ("hidden_size", t.hidden_size, target_cfg.hidden_size),
                             ("num_hidden_layers", t.num_hidden_layers, target_cfg.num_hidden_layers),
                             ("vocab_size", t.vocab_size, target_cfg.vocab_size)):
        if str(held) != str(want):
            raise UserError(f"store {store} was extracted from a target with {name} {held}, --target has "
                            f"{name} {want}")
    content_hash = target_content_hash(target)
    if content_hash != t.content_hash:
        raise UserError(f"store {store} was extracted from target {t.path} (content hash {t.content_hash[:12]}), "
                        f"--target {target} has other weights (content hash {content_hash[:12]}); train with the "
                        "target the store was extracted from")


def run_training(config: TrainConfig) -> None:
    """``peagle train``: build, train, close (every rank runs this)."""
    logging.basicConfig(level=logging.INFO, format="peagle: %(message)s")
    trainer = Trainer(config)
    try:
        trainer.build()
        trainer.train()
    finally:
        trainer.close()
