"""EAGLE-3 with training-time test (``--method eagle3``): the draft unrolls its own hidden states for K steps.

* **Item**: every chain COD's pools hold, nothing drawn (``cod.every_chain``): depth 0 at every
  position, depth d at every supervised position whose chain of d drafts is supervised. Step j of
  the unroll trains depth j at all of them, as speculators' ``Eagle3DraftModel`` trains every
  position at every step.
* **Batch**: one BlockMask per depth of a unit: depth j's elements (queries) over every element up
  to them (keys), the P-EAGLE rule with ``rows`` (docs/mask.md).
* **Forward**: K draft forwards (``peagle.model.sequential.unroll``). Step 0 is depth 0: token
  ``x_{p+1}`` and ``fc(aux_p)``. Step j feeds each depth-j element the pre-norm output of its
  parent (same anchor, depth j-1) in place of the target's aux states, and the data's token at its
  reference position (teacher-forced tokens, as EAGLE-3's reference training and speculators'
  ``use_off_policy_tokens``; under greedy verification a chain lives only while the drafts equal
  the target's tokens), at RoPE position anchor + j; it sees the real context up to its anchor and
  its own chain, the keys of earlier steps coming from a per-layer cache. This is what vLLM's
  ``eagle3`` proposer computes, one slot per forward (docs/methods.md).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from peagle.model.draft import PEagleDraft
from peagle.model.flex import FlexFn
from peagle.model.mask import cod_block_indices
from peagle.model.sequential import unroll
from peagle.pipeline.store_reader import TrainingSample
from peagle.schemas.cod_settings import CodSettings
from peagle.stages.train.attention import unit_mask
from peagle.stages.train.cod import every_chain
from peagle.stages.train.methods.method import unit_view
from peagle.stages.train.segments import UnitPlan
from peagle.stages.train.train_batch import TrainBatch


def depth_slices(depth_starts: tuple[int, ...]) -> list[slice]:
    """The unit's non-empty depth groups, in order (chains are prefix-closed: empty ones come last)."""
    return [slice(start, stop) for start, stop in zip(depth_starts, depth_starts[1:]) if stop > start]


class Eagle3:
    name = "eagle3"

    def draw(self, sample: TrainingSample, cod: CodSettings, *, seed: int, epoch: int) -> tuple[Tensor, Tensor]:
        return every_chain(sample.num_positions, sample.supervised_T, cod.num_depths)

    def block_indices(self, anchor_M: Tensor, depth_M: Tensor, doc_lengths_D: Tensor, num_tokens: int,
                      block_size: int, depth_starts: tuple[int, ...]) -> Any:
        return tuple(cod_block_indices(anchor_M, depth_M, doc_lengths_D, num_tokens, block_size=block_size, rows=rows)
                     for rows in depth_slices(depth_starts))

    def unit_inputs(self, batch: TrainBatch, plan: UnitPlan, attention: str) -> tuple:
        view = unit_view(batch, plan)
        steps = depth_slices(plan.depth_starts)
        indices = plan.block_indices or (None,) * len(steps)
        masks = [unit_mask(attention, view.anchor_M, view.depth_M, view.doc_M, block, rows)
                 for block, rows in zip(indices, steps)]
        tokens_M = batch.tokens_T[view.anchor_M + view.depth_M]  # the data's token at the reference position
        return (tokens_M, batch.aux_states(view.real_R), view.position_ids_M, view.anchor_M, plan.depth_starts,
                masks)

    def hidden_states(self, draft: PEagleDraft, inputs: tuple, flex: FlexFn | None) -> Tensor:
        return unroll(draft, *inputs, flex=flex)


EAGLE3 = Eagle3()
