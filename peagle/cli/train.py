"""``peagle train``: flags generated from ``TrainConfig`` and its parts (README.md, docs/draft-and-export.md, docs/reliability.md), then the trainer.

Run it as is for one process, or as ``torchrun --nproc-per-node N -m peagle train ...`` for data
parallelism (every rank runs this same command).
"""

from __future__ import annotations

from peagle.cli import app
from peagle.cli.config_command import ConfigCommand
from peagle.schemas.draft_config import DRAFT_METHODS
from peagle.schemas.tracking_config import TRACKING_METAVARS
from peagle.schemas.optimizer_settings import OPTIMIZERS
from peagle.schemas.train_config import ATTENTION_BACKENDS, DRAFT_ARCHITECTURES, LOSSES, TrainConfig

_HELP = """Train a draft on shard stores written by `peagle extract`: P-EAGLE (the default, all K tokens in
one forward) or EAGLE-3 with training-time test (`--method eagle3`), from the same store.

Writes RUN_DIR/metrics.jsonl and RUN_DIR/checkpoints/; re-running the same command resumes from the
newest valid checkpoint (also after kill -9). One run owns RUN_DIR while it runs (RUN_DIR/.lock): a
second run into the same --out is refused, naming the first's pid and host. A step whose loss or
gradient norm is NaN or inf is not applied; its samples go to RUN_DIR/bad_steps.jsonl, and more than
--max-bad-steps of them stop the run after a checkpoint of the last good weights. Under torchrun (`-m peagle train`, as below) it trains with DDP (--fsdp:
FSDP2, with --optimizer adamw). With --follow it trains while extraction still commits into the
store (RUN_DIR/epochs.json records the shards of every epoch). With --logger it logs live to TensorBoard, W&B,
MLflow or Trackio (RUN_DIR/trackers.json names the runs a resume continues). Examples:

\b
  peagle vocab --store STORE --draft-vocab-size SIZE
  peagle train --store STORE --target MODEL_DIR --out RUN_DIR --max-steps STEPS
  torchrun --nproc-per-node GPUS -m peagle train --store STORE --target MODEL_DIR --out RUN_DIR --max-steps STEPS
  peagle train --follow --store STORE --target MODEL_DIR --out RUN_DIR --max-steps STEPS
"""


def _run(config: TrainConfig) -> None:
    from peagle.stages.train.loop import run_training

    run_training(config)


COMMAND = ConfigCommand(
    name="train", config_class=TrainConfig, run=_run, help=_HELP,
    metavars={"store": "STORE[:WEIGHT]", "target": "MODEL_DIR", "out": "RUN_DIR", "method": "|".join(DRAFT_METHODS),
              "attention": "|".join(ATTENTION_BACKENDS),
              "draft_architecture": "|".join(DRAFT_ARCHITECTURES),
              "eval_store": "STORE", "init_from": "EXPORT_DIR", "optimizer": "|".join(OPTIMIZERS),
              "loss": "|".join(LOSSES), "epoch_shards": "FILE", "follow_timeout": "SECONDS", **TRACKING_METAVARS})
COMMAND.register(app)
