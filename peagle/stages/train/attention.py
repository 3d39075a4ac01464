"""Which attention a training run uses, and a unit's mask in that form (docs/mask.md).

The mask is the P-EAGLE rule (:mod:`peagle.model.mask`) in one of three forms: a flex ``BlockMask``
from the indices the loader workers planned (CUDA), one dense bool mask (SDPA), or one dense mask per
document (:class:`peagle.model.mask.DocumentMasks`, SDPA on the CPU). Both training methods build
their masks here: P-EAGLE one per unit, EAGLE-3 one per depth (``rows``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from peagle.model.mask import block_mask_from_indices, dense_mask, document_masks, peagle_mask_mod
from peagle.schemas.errors import UserError

SDPA_PER_DOCUMENT = "sdpa_per_document"
"""The resolved attention of ``sdpa`` on the CPU: SDPA over each document's elements alone
(:class:`peagle.model.mask.DocumentMasks`), the same result as one dense mask at a fraction of the
N^2 work. Splitting by document reads the document ids on the host, free on the CPU; elsewhere
``sdpa`` stays one dense mask, built without a host read."""


def resolve_attention(attention: str, device: torch.device) -> str:
    """``auto`` is flex on CUDA and SDPA elsewhere (per document on the CPU); flex training off CUDA is
    refused (no CPU backward)."""
    if attention == "auto":
        attention = "flex" if device.type == "cuda" else "sdpa"
    if attention == "flex" and device.type != "cuda":
        raise UserError("--attention flex needs a CUDA device for training (flex_attention has no CPU "
                        "backward); use --attention sdpa or auto on CPU")
    return SDPA_PER_DOCUMENT if attention == "sdpa" and device.type == "cpu" else attention


def unit_mask(attention: str, anchor_M: Tensor, depth_M: Tensor, doc_M: Tensor, block_indices: Any,
              rows: slice | None = None) -> Any:
    """The unit's mask (all its elements, or the queries ``rows`` over the keys before ``rows.stop``) in
    the form ``attention`` reads; ``block_indices`` are the planned ones for exactly that shape."""
    if attention == "flex":
        return block_mask_from_indices(block_indices, peagle_mask_mod(anchor_M, depth_M, doc_M, rows),
                                       device=anchor_M.device)
    if attention == SDPA_PER_DOCUMENT:
        return document_masks(anchor_M, depth_M, doc_M, rows)
    return dense_mask(anchor_M, depth_M, doc_M, rows)
