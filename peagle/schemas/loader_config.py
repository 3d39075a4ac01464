"""The configuration of the training data stream: which stores, how samples become batches.

``TrainConfig`` is what a user writes; the trainer turns it into one ``LoaderConfig`` per stream
(training, evaluation). Fields marked (plan) fix the order of the stream: a resumed loader refuses
a change to any of them (``stages/train/loader.TrainLoader.load_state_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from peagle.schemas.errors import UserError
from peagle.schemas.train_config import StoreSpec

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
    mask_token_id: int | None = None  # default: the stores' StoreSettings.mask_token_id
    aux_layer_ids: tuple[int, ...] | None = None  # what the draft reads; None = whatever the stores hold

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise UserError(f"split must be one of {'|'.join(SPLITS)}, got {self.split!r}")
        if self.token_budget < 1 or self.shuffle_window < 1:
            raise UserError(f"token_budget and shuffle_window must be >= 1, got {self.token_budget}, "
                            f"{self.shuffle_window}")
        if self.attention not in LOADER_ATTENTION:
            raise UserError(f"loader attention must be flex or sdpa, got {self.attention!r}")
