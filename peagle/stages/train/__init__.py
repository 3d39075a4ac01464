"""The train stage: COD sampling and segment planning (pure algorithms, docs/cod.md and docs/mask.md) and the trainer."""

from peagle.stages.train.cod import cod_depth_counts, cod_generator, generate_cod_sample_indices, pack_cod
from peagle.stages.train.segments import SegmentPlan, assign_cod_segments, plan_segments

__all__ = [
    "SegmentPlan",
    "assign_cod_segments",
    "cod_depth_counts",
    "cod_generator",
    "generate_cod_sample_indices",
    "pack_cod",
    "plan_segments",
]
