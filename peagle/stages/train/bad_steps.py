"""Steps that were not applied because their loss or gradient norm was not finite, and when to stop.

The step (``step.TrainStep``) skips the optimizer on such a step (docstring there). The trainer then
counts it here, over the whole run (the count is part of the checkpoint's train state, so a resume
does not start the budget afresh), and records which samples its batches held, in
``RUN_DIR/bad_steps.jsonl`` (one line per bad step: step, epoch, and every sample as sample id,
store and shard; rank 0 writes what every rank held). The samples of a NaN step are the usual
culprit (one NaN aux value in a store suffices), but the step cannot tell which of them it was, so
all are named.

More than ``--max-bad-steps`` of them stop the run, in one line naming the stores, shards and sample
ids, once the trainer has saved a checkpoint of the weights as they are: the bad steps were never
applied, so those weights are the last good ones. Re-run, such a run goes on from that checkpoint
(past the bad batches) until its next bad step, which stops it again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

from peagle.pipeline.contained import inside
from peagle.schemas.errors import UserError
from peagle.schemas.run_files import BAD_STEPS_FILE
from peagle.schemas.store import shard_stem
from peagle.stages.train.metrics_file import truncate_jsonl
from peagle.stages.train.train_batch import TrainBatch

NAMED_SAMPLES = 6  # in the stop line; the file holds them all

Sample = tuple[str, str, int]
"""(sample id, store root, shard index)."""


def batch_samples(batches: list[TrainBatch]) -> list[Sample]:
    """Every sample of a step's micro-batches with the store and shard it came from."""
    out = []
    for batch in batches:
        sources = batch.sources or (("?", -1),) * len(batch.sample_ids)
        out += [(sample_id, store, shard) for sample_id, (store, shard) in zip(batch.sample_ids, sources)]
    return out


class BadSteps:
    """The run's count of bad steps, their record file (rank 0) and the budget (module docstring)."""

    def __init__(self, run_dir: Path, *, max_bad_steps: int, rank: int = 0):
        self.run_dir, self.max_bad_steps, self.rank = run_dir, max_bad_steps, rank
        self.count = 0  # over the run, resumes included
        self.seen: list[tuple[int, list[Sample]]] = []  # this process's bad steps, for the stop line

    def resume(self, step: int, count: int) -> None:
        """Continue a checkpointed run: its count, and its record file cut back to the checkpoint's step."""
        self.count = count
        if self.rank == 0:
            truncate_jsonl(inside(self.run_dir, BAD_STEPS_FILE, tree="run"), step)

    def record(self, step: int, batches: list[TrainBatch], *, cpu_group: Any = None) -> str:
        """Count bad step ``step``, append its line (the samples of every rank's ``batches``) and return
        the warning line to print. A collective under torch.distributed: every rank has the same bad step."""
        samples = batch_samples(batches)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, samples, group=cpu_group)
            samples = [sample for part in gathered for sample in part]
        self.count += 1
        self.seen.append((step, samples))
        if self.rank == 0:
            line = {"step": step, "epoch": batches[0].epoch,
                    "samples": [{"sample_id": i, "store": store, "shard": shard} for i, store, shard in samples]}
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(inside(self.run_dir, BAD_STEPS_FILE, tree="run"), "a") as f:  # never through a link out
                f.write(json.dumps(line) + "\n")
        return (f"warning: step {step}: the loss or gradient norm is not finite; the step is not applied "
                f"({_steps(self.count)} so far, --max-bad-steps {self.max_bad_steps}; its samples are in "
                f"{self.run_dir / BAD_STEPS_FILE})")

    @property
    def over_budget(self) -> bool:
        return self.count > self.max_bad_steps

    def stop_error(self, checkpoint: Path) -> UserError:
        """The one line that stops the run (module docstring); ``checkpoint`` (just saved) keeps the last
        good weights."""
        steps = [step for step, _ in self.seen]
        samples = list(dict.fromkeys(s for _, batch in self.seen for s in batch))
        by_shard: dict[tuple[str, int], list[str]] = {}
        for sample_id, store, shard in samples[:NAMED_SAMPLES]:
            by_shard.setdefault((store, shard), []).append(sample_id)
        named = ", ".join(f"store {store} shard {shard_stem(shard) if shard >= 0 else '?'} ({', '.join(ids)})"
                          for (store, shard), ids in by_shard.items())
        more = f" and {len(samples) - NAMED_SAMPLES} more samples" if len(samples) > NAMED_SAMPLES else ""
        return UserError(
            f"{_steps(self.count)} had a non-finite loss or gradient norm, more than --max-bad-steps "
            f"{self.max_bad_steps}; none was applied (this process: step{'s' if len(steps) > 1 else ''} "
            f"{', '.join(map(str, steps))}); their batches held {named}{more}; {checkpoint} keeps the last "
            f"good weights; {self.run_dir / BAD_STEPS_FILE} lists every sample of every bad step")


def _steps(n: int) -> str:
    return f"{n} step{'' if n == 1 else 's'}"
