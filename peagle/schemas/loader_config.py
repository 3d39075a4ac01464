"""The configuration of the training data stream: which stores, how samples become batches.

``TrainConfig`` is what a user writes; the trainer turns it into one ``LoaderConfig`` per stream
(training, evaluation). Fields marked (plan) fix the order of the stream: a resumed loader refuses
a change to any of them (``stages/train/loader.TrainLoader.load_state_dict``). The COD part
(``CodSettings``, its own home) is the run's, handed over whole; the other fields are per stream (the
evaluation stream reads its own store or split, in the training process), so they are made here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from peagle.schemas.cod_settings import CodSettings
from peagle.schemas.data_settings import StoreSpec, parse_store_spec
from peagle.schemas.errors import UserError
from peagle.schemas.train_config import TrainConfig

SPLITS = ("train", "heldout", "all")
LOADER_ATTENTION = ("flex", "sdpa")

DEFAULT_BLOCK_SIZE = 128
"""Query/key block of flex attention's BlockMask: the loader computes block indices for it and the
model wraps them (peagle.model.mask)."""


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
    data = c.data
    stores, split, fraction = data.stores(), "train", data.heldout_fraction
    if data.eval_store is not None:
        stores, split, fraction = ([parse_store_spec(data.eval_store)] if eval_split else stores), "all", 0.0
    elif eval_split:
        if data.heldout_fraction == 0:
            return None
        split = "heldout"
    return LoaderConfig(
        stores=tuple(stores), seed=c.seed, token_budget=data.token_budget, method=c.method, cod=c.cod,
        split=split, heldout_fraction=fraction, shuffle=not eval_split,
        sequence_partitions=c.sequence_partitions, attention="flex" if attention == "flex" else "sdpa",
        num_workers=0 if eval_split else data.num_workers, pin_memory=on_cuda,
        verify=data.verify, dequantize_in_workers=not on_cuda, allow_bad_aux_rows=data.allow_bad_aux_rows,
        allow_incomplete=data.allow_incomplete, aux_layer_ids=tuple(aux_layer_ids))
