"""The configuration of the training data stream: which stores, how samples become batches.

``TrainConfig`` is what a user writes; the trainer turns it into one ``LoaderConfig`` per stream
(training, evaluation). Fields marked (plan) fix the order of the stream: a resumed loader refuses
a change to any of them (``stages/train/loader.TrainLoader.load_state_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from peagle.schemas.errors import UserError
from peagle.schemas.train_config import StoreSpec, TrainConfig, parse_store_spec

SPLITS = ("train", "heldout", "all")
LOADER_ATTENTION = ("flex", "sdpa")

DEFAULT_BLOCK_SIZE = 128
"""Query/key block of flex attention's BlockMask: the loader computes block indices for it and the
model wraps them (peagle.model.mask)."""


@dataclass(frozen=True, kw_only=True)
class CodSettings:
    """How COD sampling draws a sample's elements (docs/cod.md)."""

    num_depths: int = 8
    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2
    max_anchors: int | None = None


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """Everything the data stream depends on. Fields marked (plan) must not change across a resume."""

    stores: tuple[StoreSpec, ...]
    seed: int = 0  # (plan)
    token_budget: int = 16384  # (plan) training positions (n − 1 per sample) per batch
    cod: CodSettings = field(default_factory=CodSettings)  # (plan)
    method: str = "peagle"  # (plan) the training method: which elements an item holds (stages/train/methods)
    split: str = "train"  # (plan) train | heldout | all
    heldout_fraction: float = 0.0  # (plan)
    shuffle: bool = True  # (plan)
    shuffle_window: int = 4  # (plan) units whose samples are shuffled together
    sequence_partitions: int = 1
    attention: str = "sdpa"  # flex: block indices are computed in the workers
    block_size: int = DEFAULT_BLOCK_SIZE
    num_workers: int = 0
    prefetch_factor: int = 2
    pin_memory: bool = False
    verify: bool = False
    dequantize_in_workers: bool = True  # fp8 stores: workers dequantise (CPU); False ships fp8 to the device
    allow_bad_aux_rows: bool = False  # train on stores whose commit statistics show zero/non-finite rows
    allow_incomplete: bool = False  # train on stores with planned shards not committed (peagle.pipeline.plan)
    aux_layer_ids: tuple[int, ...] | None = None  # what the draft reads; None = whatever the stores hold

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise UserError(f"split must be one of {'|'.join(SPLITS)}, got {self.split!r}")
        if self.token_budget < 1 or self.shuffle_window < 1:
            raise UserError(f"token_budget and shuffle_window must be >= 1, got {self.token_budget}, "
                            f"{self.shuffle_window}")
        if self.attention not in LOADER_ATTENTION:
            raise UserError(f"loader attention must be flex or sdpa, got {self.attention!r}")


def stream_config(c: TrainConfig, *, aux_layer_ids: tuple[int, ...], attention: str, on_cuda: bool,
                  eval_split: bool) -> LoaderConfig | None:
    """The training stream of a run, or its evaluation stream (the eval store, else the held-out split;
    None if neither). ``attention`` is the step's resolved one; the loader only needs to know whether
    it is flex (block indices) or any form of SDPA."""
    stores, split, fraction = c.stores(), "train", c.heldout_fraction
    if c.eval_store is not None:
        stores, split, fraction = ([parse_store_spec(c.eval_store)] if eval_split else stores), "all", 0.0
    elif eval_split:
        if c.heldout_fraction == 0:
            return None
        split = "heldout"
    return LoaderConfig(
        stores=tuple(stores), seed=c.seed, token_budget=c.token_budget, method=c.method,
        cod=CodSettings(num_depths=c.num_depths, down_sample_ratio=c.down_sample_ratio,
                        down_sample_ratio_min=c.down_sample_ratio_min, max_anchors=c.max_anchors),
        split=split, heldout_fraction=fraction, shuffle=not eval_split,
        sequence_partitions=c.sequence_partitions, attention="flex" if attention == "flex" else "sdpa",
        num_workers=0 if eval_split else c.num_workers, pin_memory=on_cuda,
        verify=c.verify, dequantize_in_workers=not on_cuda, allow_bad_aux_rows=c.allow_bad_aux_rows,
        allow_incomplete=c.allow_incomplete, aux_layer_ids=tuple(aux_layer_ids))
