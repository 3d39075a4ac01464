"""P-EAGLE (the default ``--method``): all K depths in one forward, deeper depths from mask slots.

* **Item**: COD sampling (docs/cod.md): every position at depth 0, a shrinking random subset of the
  supervised chains at each deeper depth, seeded by (seed, epoch, sample_id).
* **Batch**: one square BlockMask per unit, the P-EAGLE rule over all its elements (docs/mask.md).
* **Forward**: one draft forward over the unit (``PEagleDraft.forward``): depth-0 rows read their
  token and aux state, deeper ones the mask token (``DraftConfig.mask_token_id``, the store's) and
  ``mask_hidden``; each sees the real context up to its anchor and its own chain.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from peagle.model.draft import PEagleDraft
from peagle.model.flex import FlexFn
from peagle.model.mask import cod_block_indices
from peagle.pipeline.store_reader import TrainingSample
from peagle.schemas.cod_settings import CodSettings
from peagle.stages.train.attention import unit_mask
from peagle.stages.train.cod import cod_generator, generate_cod_sample_indices
from peagle.stages.train.methods.method import unit_view
from peagle.stages.train.segments import UnitPlan
from peagle.stages.train.train_batch import TrainBatch


class PEagle:
    name = "peagle"

    def draw(self, sample: TrainingSample, cod: CodSettings, *, seed: int, epoch: int) -> tuple[Tensor, Tensor]:
        return generate_cod_sample_indices(
            sample.num_positions, sample.supervised_T, cod.num_depths, cod.down_sample_ratio,
            cod.down_sample_ratio_min, True, generator=cod_generator(seed, epoch, sample.sample_id),
            max_anchors=cod.max_anchors)

    def block_indices(self, anchor_M: Tensor, depth_M: Tensor, doc_lengths_D: Tensor, num_tokens: int,
                      block_size: int, depth_starts: tuple[int, ...]) -> Any:
        return cod_block_indices(anchor_M, depth_M, doc_lengths_D, num_tokens, block_size=block_size)

    def unit_inputs(self, batch: TrainBatch, plan: UnitPlan, attention: str) -> tuple:
        view = unit_view(batch, plan)
        tokens_R = batch.tokens_T if view.real_R is None else batch.tokens_T[view.real_R]
        mask = unit_mask(attention, view.anchor_M, view.depth_M, view.doc_M, plan.block_indices)
        return tokens_R, batch.aux_states(view.real_R), view.position_ids_M, mask  # fp8 aux: dequantised here

    def hidden_states(self, draft: PEagleDraft, inputs: tuple, flex: FlexFn | None) -> Tensor:
        return draft(*inputs, flex)


PEAGLE = PEagle()
