"""Train speculators 0.9.0's P-EAGLE draft on a peagle store with speculators' own code (benchmarks/peer_ab.py).

    .venv-speculators/bin/python benchmarks/peer_ab_speculators.py --store S --target T --out RUN \\
        --tokens N [--store-vocab] -- SPECULATORS_TRAIN_FLAGS...

Run in the speculators environment with this repository on ``PYTHONPATH`` (peer_ab.py does both).
The flags after ``--`` are ``speculators train`` flags: they are resolved by speculators' own
``TrainConfig`` (its defaults fill the rest), and every step after that is the one its
``speculators train`` (speculators/train/cli.py ``main``) takes, in its order: ``set_seed``, its
vocab mapping (``parse_vocab_mappings``: from its token-frequency count of the store's supervised
tokens, or the store's peagle vocabulary with ``--store-vocab``), ``build_draft_model`` (draft shape
from the target's config, its mask-token rule, verifier weights), its batch sampler, ``CollateFn``
and ``shift_batch``, ``get_trainer_kwargs`` (COD settings, its loss), and its ``Trainer`` (its
optimizers, LR schedule, autocast, gradient clipping, checkpoint). Only the data source differs:
the store, converted by :mod:`peer_ab_data` (read there why, and what the targets are).

What this script sets itself: the verifier and its aux layers (the store's), the data and save
paths, and the run length: ``--max-steps`` is the first step at which the positions trained (its
packed rows, after its shift) reach ``--tokens`` (the peagle run's, so both see the same number),
and ``--epochs`` what that takes. Shims let the trainer run without an accelerator: the trainer's
device is the CPU, its autocast device type ``cpu``, ``torch.accelerator.synchronize`` (its step
timer's sync) a no-op, none of which changes what a step computes; and ``torch.optim.Muon``'s
Newton-Schulz iteration runs in fp32 instead of bf16 (:func:`fp32_newton_schulz`), as every other
computation here does (``--hidden-states-dtype float32``).

Writes ``RUN/export/`` (the last checkpoint's ``config.json`` and ``model.safetensors``: speculators'
format, which vLLM serves), ``RUN/metrics.jsonl`` (its per-step training metrics),
``RUN/speculators_run.yaml`` (its own record of the resolved configuration, every default included)
and ``RUN/run.json`` (the flags, steps, epochs and positions trained).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.optim._muon as torch_muon
import speculators.train.trainer as speculators_trainer
from speculators.models.eagle3.data import shift_batch
from speculators.models.peagle import PEagleDraftModel
from speculators.train.cli import build_draft_model, parse_vocab_mappings, set_seed
from speculators.train.config import TrainConfig
from speculators.train.dataloader import _setup_dataloader
from speculators.train.trainer import Trainer, TrainerConfig

import peer_ab_data as data
from peagle.pipeline.store import read_settings

METRICS_LOGGER = "speculators.metrics"


def resolve(flags: list[str]) -> tuple[TrainConfig, argparse.Namespace]:
    """speculators' own resolution of ``speculators train`` flags, and the flat namespace its main() uses."""
    cfg = TrainConfig.resolve(flags)
    return cfg, argparse.Namespace(**cfg.flatten())


def steps_for_positions(sampler, wanted: int) -> tuple[int, int, int]:
    """(steps, epochs, positions) of the shortest run of speculators' batches, epoch after epoch in its
    own order, whose training positions (a sample of n tokens has n − 1 after ``shift_batch``) reach
    ``wanted``."""
    seen = steps = epoch = 0
    while seen < wanted:
        sampler.set_epoch(epoch)
        batches = list(iter(sampler))
        if not batches:
            raise SystemExit("peer_ab_speculators: the store gives no batch")
        for batch in batches:
            seen += int(sum(max(int(sampler.lengths[i]) - 1, 0) for i in batch))
            steps += 1
            if seen >= wanted:
                break
        epoch += 1
    sampler.set_epoch(0)
    return steps, epoch, seen


def trainer_config(args: argparse.Namespace) -> TrainerConfig:
    """``TrainerConfig`` from the flat args, field by field as speculators' main() builds it."""
    train_call_kwargs, val_call_kwargs = PEagleDraftModel.get_trainer_kwargs(**vars(args))
    return TrainerConfig(
        num_epochs=args.epochs, save_path=args.save_path, lr=args.lr,
        resume_from_checkpoint=not args.no_resume_from_checkpoint,
        train_call_kwargs=train_call_kwargs, val_call_kwargs=val_call_kwargs,
        optimizer=args.optimizer, weight_decay=args.weight_decay, muon_lr=args.muon_lr,
        muon_momentum=args.muon_momentum, muon_weight_decay=args.muon_weight_decay,
        muon_ns_steps=args.muon_ns_steps, muon_adjust_lr_fn=args.muon_adjust_lr_fn,
        scheduler_type=args.scheduler_type, scheduler_warmup_steps=args.scheduler_warmup_steps,
        scheduler_warmup_ratio=args.scheduler_warmup_ratio, scheduler_total_steps=args.scheduler_total_steps,
        scheduler_num_cosine_cycles=args.scheduler_num_cosine_cycles, checkpoint_freq=args.checkpoint_freq,
        save_best=args.save_best, hidden_states_dtype=getattr(torch, args.hidden_states_dtype),
        log_freq=args.log_freq, fsdp_shard=args.fsdp_shard, gradient_checkpointing=args.gradient_checkpointing,
        max_steps=args.max_steps,
    )


def fp32_newton_schulz(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                       eps: float) -> torch.Tensor:
    """``torch.optim.Muon``'s Newton-Schulz orthogonalisation (torch/optim/_muon.py, the same steps and
    coefficients) in fp32 instead of bf16: this CPU has no bf16 arithmetic, and emulated bf16 made
    one Muon step of a SmolLM2-sized draft take minutes (peagle's Muon iterates in fp32 too)."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.float().T if tall else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def cpu_trainer(model, config: TrainerConfig, loader) -> Trainer:
    """speculators' Trainer on a machine without an accelerator (the shims of the module docstring)."""
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *_args, **_kwargs: None
        torch_muon._zeropower_via_newtonschulz = fp32_newton_schulz
    speculators_trainer.get_local_rank = lambda: "cpu"
    trainer = Trainer(model, config, loader, None)
    trainer.device_type = "cpu"
    return trainer


class JsonLines(logging.Handler):
    """speculators' metric records (dicts logged on ``speculators.metrics``) as JSON lines."""

    def __init__(self, path: Path):
        super().__init__(logging.INFO)
        self.file = open(path, "w")

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict):
            self.file.write(json.dumps(record.msg, default=float) + "\n")
            self.file.flush()

    def close(self) -> None:
        self.file.close()
        super().close()


def publish_export(checkpoint: Path, export: Path) -> None:
    """The checkpoint's config.json and model.safetensors into ``export``, renamed into place whole."""
    partial = export.with_name(export.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(checkpoint / name, partial / name)
    shutil.rmtree(export, ignore_errors=True)
    partial.rename(export)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="peagle store the draft trains on")
    ap.add_argument("--target", required=True, help="the store's target model directory (speculators' verifier)")
    ap.add_argument("--out", type=Path, required=True, help="run directory (emptied first)")
    ap.add_argument("--tokens", type=int, required=True, help="training positions to see (sets --max-steps)")
    ap.add_argument("--store-vocab", action="store_true", help="use the store's peagle draft vocabulary of "
                    "--draft-vocab-size instead of speculators' own count")
    opts = ap.parse_args(ours)
    started = time.monotonic()
    shutil.rmtree(opts.out, ignore_errors=True)
    data_dir, save_path = opts.out / "data", opts.out / "checkpoints"
    data_dir.mkdir(parents=True)
    settings = read_settings(opts.store)
    fixed = ["--verifier-name-or-path", str(opts.target), "--data-path", str(data_dir), "--save-path", str(save_path),
             "--target-layer-ids", *map(str, settings.aux_layer_ids), "--no-resume-from-checkpoint"]
    cfg, args = resolve(flags + fixed)
    target_vocab_size = settings.target.vocab_size
    if opts.store_vocab:
        d2t_path, t2d_path = data.write_store_vocab(opts.store, args.draft_vocab_size, data_dir)
        fixed += ["--d2t-path", str(d2t_path), "--t2d-path", str(t2d_path)]
    else:
        everything = data.StoreSamples(opts.store, data.target_to_draft_of(None, target_vocab_size),
                                       target_vocab_size, args.total_seq_len)
        data.write_token_frequencies(everything, data_dir / "token_freq.pt")
    cfg, args = resolve(flags + fixed)
    d2t, t2d, draft_vocab_size = parse_vocab_mappings(args)
    samples = data.StoreSamples(opts.store, data.target_to_draft_of(t2d, target_vocab_size), draft_vocab_size,
                                args.total_seq_len, getattr(torch, args.hidden_states_dtype))
    hidden_size = settings.target.hidden_size
    loader = _setup_dataloader(samples, args.total_seq_len, hidden_size, num_workers=args.num_workers,
                               num_target_layers=len(settings.aux_layer_ids), prefetch_factor=args.prefetch_factor,
                               preprocess=shift_batch, seed=args.seed)
    steps, epochs, positions = steps_for_positions(loader.batch_sampler, opts.tokens)
    # Checkpoints at epoch 0 (speculators always writes it) and the last epoch only.
    fixed += ["--max-steps", str(steps), "--epochs", str(epochs), "--checkpoint-freq", str(epochs)]
    cfg, args = resolve(flags + fixed)
    set_seed(args.seed)
    model = build_draft_model(args, PEagleDraftModel, t2d, d2t, draft_vocab_size)
    data.use_store_targets(model)
    cfg.save(args.save_path)  # speculators' run.yaml + train_command.txt, as its main() writes them
    metrics = logging.getLogger(METRICS_LOGGER)
    metrics.setLevel(logging.INFO)
    metrics.propagate = False
    handler = JsonLines(opts.out / "metrics.jsonl")
    metrics.addHandler(handler)
    try:  # the handler goes with the run: a second run in this process writes only its own file
        trainer = cpu_trainer(model, trainer_config(args), loader)
        trained = time.monotonic()
        trainer.run_training()
        train_seconds = time.monotonic() - trained
    finally:
        metrics.removeHandler(handler)
        handler.close()
    publish_export(save_path / str(epochs - 1), opts.out / "export")
    shutil.move(save_path / "run.yaml", opts.out / "speculators_run.yaml")
    shutil.rmtree(save_path)
    summary = {"flags": flags + fixed, "steps": steps, "epochs": epochs, "positions": positions,
               "positions_wanted": opts.tokens, "global_step": trainer.global_step,
               "mask_token_id": int(model.config.mask_token_id), "draft_vocab_size": int(draft_vocab_size),
               "draft_arch": model.config.transformer_layer_config.model_type,
               "train_seconds": train_seconds, "seconds": time.monotonic() - started}
    (opts.out / "run.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
