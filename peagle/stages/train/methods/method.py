"""The interface of a training method (docs/methods.md): three questions, one answer each.

* **What an item is** (:meth:`TrainingMethod.draw`, in the loader workers): which elements
  (anchor, depth) one sample contributes, in flat COD layout (docs/cod.md).
* **How a batch is collated** (:meth:`TrainingMethod.block_indices`, in the loader workers):
  packing, targets, chains and units are shared (``batch.collate``, ``segments.plan_units``); a
  method adds only the flex block indices of a unit, which follow from how its forward attends.
* **How a unit runs forward** (:meth:`TrainingMethod.unit_inputs` on the device, then
  :meth:`TrainingMethod.hidden_states` inside the DDP/FSDP-wrapped module): the final-normed hidden
  state of every element of the unit. What the loss, the agreement and the chain acceptance see is
  the same for every method: the supervised rows of those states against the stored top-k
  (``loss.chunked_loss_sum``, ``loss.chain_acceptance``).

Everything else (the store, the loader workers, resume, DDP, the optimizer, the step's
bookkeeping, the metrics) is the trainer's and shared. A method is a stateless object with a
``name``; ``methods/__init__.py`` lists them.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from torch import Tensor

from peagle.model.draft import PEagleDraft
from peagle.model.flex import FlexFn
from peagle.pipeline.store_reader import TrainingSample
from peagle.schemas.cod_settings import CodSettings
from peagle.stages.train.segments import UnitPlan
from peagle.stages.train.train_batch import TrainBatch


class TrainingMethod(Protocol):
    name: str
    """The ``--method`` value, and ``DraftConfig.method`` of the drafts it trains."""

    def draw(self, sample: TrainingSample, cod: CodSettings, *, seed: int, epoch: int) -> tuple[Tensor, Tensor]:
        """``(anchor_pos, depth)`` of one sample's elements, flat COD layout, chains complete; a
        function of (seed, epoch, sample_id) and the sample only (any rank, worker or resume)."""

    def block_indices(self, anchor_M: Tensor, depth_M: Tensor, doc_lengths_D: Tensor, num_tokens: int,
                      block_size: int, depth_starts: tuple[int, ...]) -> Any:
        """The flex BlockMask indices of one unit (``UnitPlan.block_indices``), on the CPU."""

    def unit_inputs(self, batch: TrainBatch, plan: UnitPlan, attention: str) -> tuple:
        """What :meth:`hidden_states` reads for one unit of a batch on the device: gathers and masks,
        no host read (docs/performance.md)."""

    def hidden_states(self, draft: PEagleDraft, inputs: tuple, flex: FlexFn | None) -> Tensor:
        """Final-normed hidden ``[M, H]`` of the unit's M elements, in the unit's order."""


class UnitView(NamedTuple):
    """A unit's element metadata and depth-0 rows, gathered from a batch on the device."""

    anchor_M: Tensor
    depth_M: Tensor
    doc_M: Tensor
    position_ids_M: Tensor
    real_R: Tensor | None  # the unit's depth-0 elements (their flat index is their row); None: all rows


def unit_view(batch: TrainBatch, plan: UnitPlan) -> UnitView:
    """The unit's slice of the batch (``plan.element_idx_M``, None: the whole row): gathers only."""
    idx = plan.element_idx_M
    if idx is None:
        return UnitView(batch.anchor_N, batch.depth_N, batch.doc_N, batch.position_ids_N, None)
    return UnitView(batch.anchor_N[idx], batch.depth_N[idx], batch.doc_N[idx], batch.position_ids_N[idx],
                    idx[: plan.num_real])
