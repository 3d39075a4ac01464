"""Training a tiny target on chat text, cached by its settings: shared by the demo and quality targets.

A draft is only as informative as the target it learns from: a random-weight target predicts
noise. Both trained targets here (the demo's, :mod:`peagle.demo.target`, and the quality
benchmark's, :mod:`peagle.testing.quality_target`) are tiny Llamas trained from scratch on chats
made from text that ships with Python, so nothing is downloaded. This module holds what they
share: the token stream, the training loop and the atomic cache entry.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

CacheBuild = Callable[[Path], Path]
"""``build(work_dir) -> model_dir``: writes a finished model directory somewhere under ``work_dir``."""


@dataclass(frozen=True, kw_only=True)
class LmTraining:
    """How a target is trained: AdamW, linear warmup, cosine decay to 10% of ``lr``, exactly
    ``max_steps`` steps (no time budget: the weights depend on the settings alone, never on how
    fast or busy the machine was)."""

    max_steps: int
    seq_len: int
    batch_size: int
    lr: float
    seed: int
    warmup_steps: int = 50
    log_every: int = 100


def chat_token_windows(tokenizer, chats: list[dict], seq_len: int, seed: int) -> Iterator:
    """Endless stream of ``[seq_len + 1]`` windows over the rendered chats, reshuffled each pass.

    Windows start anywhere in the concatenation, so the model also learns how one chat ends and
    the next begins (the end-of-turn token).
    """
    import torch

    ids: list[int] = []
    for chat in chats:
        ids.extend(tokenizer.apply_chat_template(chat["messages"], tokenize=True)["input_ids"])
    data = torch.tensor(ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randperm(len(data) - seq_len - 1, generator=gen)
        for s in starts.tolist():
            yield data[s : s + seq_len + 1]


def train_lm(model, windows: Iterator, settings: LmTraining, *, log=print) -> dict:
    """Next-token cross-entropy training of ``model`` in place; returns steps, loss EMA, wall and
    CPU seconds (the latter says what the training costs when the machine is shared)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.01, betas=(0.9, 0.95))
    torch.manual_seed(settings.seed)
    model.train()
    start, cpu_start, step, loss_ema = time.monotonic(), time.process_time(), 0, None

    while step < settings.max_steps:
        warm = min(1.0, (step + 1) / settings.warmup_steps)
        decay = 0.5 * (1 + math.cos(math.pi * step / settings.max_steps))
        for group in opt.param_groups:
            group["lr"] = settings.lr * warm * (0.1 + 0.9 * decay)
        batch = torch.stack([next(windows) for _ in range(settings.batch_size)])
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        step += 1
        if step % settings.log_every == 0:
            log(f"  step {step}/{settings.max_steps}: loss {loss_ema:.3f} ({time.monotonic() - start:.0f} s)")
    model.eval()
    return {"steps": step, "final_loss_ema": loss_ema, "train_seconds": time.monotonic() - start,
            "train_cpu_seconds": time.process_time() - cpu_start}


def cached_model_dir(cache_dir: str | Path, name: str, build: CacheBuild) -> Path:
    """``cache_dir/name``, built first by ``build`` when the cache has no finished copy.

    ``build`` works in a private temporary directory next to the entry; its result is published by
    one rename, so a killed build leaves no half-written entry and two concurrent builders both
    end with a whole one (the loser's copy is discarded).
    """
    cache_dir = Path(cache_dir)
    out = cache_dir / name
    if (out / "config.json").exists():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    try:
        final = build(work)
        try:
            os.replace(final, out)
        except OSError:  # another process published it first
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out
