"""The logging window: sums over the optimizer steps since the last ``metrics.jsonl`` line.

The sums stay on the device (a step adds to them without a host read) and are read once per logged
line (:meth:`MetricsWindow.record`). Each line also says how many graphs torch.compile built in its
window (``graphs_compiled``: after the first steps it must stay 0, or every new COD length pays a
recompile), how many of its steps were skipped as non-finite (``bad_steps``, ``bad_steps.py``) and, on
CUDA, the memory the caching allocator holds for tensors now and at its peak.

A checkpoint holds the window in flight (:meth:`state_dict`), so the first line after a resume covers
the same steps as the uninterrupted run's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from peagle.stages.train.loss import LossStats
from peagle.stages.train.step import StepResult, compiled_graph_count, summarise


class MetricsWindow:
    """Sums of the steps since the last metrics line (module docstring)."""

    def __init__(self, num_depths: int, device: torch.device | str):
        self.num_depths, self.device = num_depths, device
        self.reset()

    def reset(self) -> None:
        self.stats = LossStats.zeros(self.num_depths, self.device)
        self.tokens, self.no_target = 0.0, 0.0
        self.grad_norm: Tensor | None = None  # the last applied step's, on the device
        self.bad_steps = 0
        self.graphs_at_start = compiled_graph_count()

    def add(self, result: StepResult, stats: LossStats) -> None:
        """One applied step: ``stats`` are its stats summed over ranks (``result.stats`` on one rank)."""
        self.stats = self.stats + stats
        self.tokens += result.num_tokens
        self.no_target += result.num_no_target
        self.grad_norm = result.grad_norm

    def add_bad_step(self) -> None:
        """A step that was not applied: counted, its (non-finite) sums left out of the window."""
        self.bad_steps += 1

    def record(self, *, step: int, lr: float, tokens_seen: int, seconds: float, data_wait_s: float) -> dict[str, Any]:
        """The window as one ``metrics.jsonl`` line (one host read of the device sums); resets the window.

        A window whose every step was skipped has no loss to report: ``loss`` is None then, not 0.
        """
        graphs = compiled_graph_count()
        summary = summarise(self.stats)
        if summary["depth_count"] and sum(summary["depth_count"]) == 0 and self.bad_steps:
            summary["loss"] = None
        record = {"kind": "train", "step": step, **summary,
                  "lr": lr, "grad_norm": None if self.grad_norm is None else float(self.grad_norm),
                  "tokens_seen": tokens_seen, "num_no_target": int(self.no_target),
                  "tokens_per_s": self.tokens / max(seconds, 1e-9),
                  "data_wait_share": min(1.0, data_wait_s / max(seconds, 1e-9)), "step_time_s": seconds,
                  "graphs_compiled": graphs - self.graphs_at_start, "bad_steps": self.bad_steps}
        if torch.device(self.device).type == "cuda":  # the allocator's counters: host-side, no sync
            record["memory_allocated_gib"] = torch.cuda.memory_allocated(self.device) / 2**30
            record["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.reset()
        return record

    def state_dict(self) -> dict[str, Any]:
        """The window in flight, on the CPU (the checkpoint's ``train_state["window"]``)."""
        state: dict[str, Any] = {"stats": self.stats.to_vector().cpu(), "tokens": self.tokens,
                                 "no_target": self.no_target, "bad_steps": self.bad_steps}
        if self.grad_norm is not None:
            state["grad_norm"] = self.grad_norm.cpu()
        return state

    def load_state_dict(self, saved: dict[str, Any]) -> str | None:
        """Restore a checkpoint's window; a warning line (and a fresh window) when its stats vector has
        another layout (an older peagle's, without the chain sums): its steps go unlogged."""
        saved = {k: (v.to(self.device) if isinstance(v, Tensor) else v) for k, v in saved.items()}
        try:
            stats = LossStats.from_vector(saved["stats"], self.num_depths)
        except ValueError as err:
            return (f"the checkpoint's metrics window has another layout ({err}); the first metrics line "
                    "after resuming covers only the steps run since")
        self.stats = stats
        self.tokens, self.no_target = saved.get("tokens", 0.0), saved.get("no_target", 0.0)
        self.grad_norm = saved.get("grad_norm")
        self.bad_steps = int(saved.get("bad_steps", 0))
        return None
