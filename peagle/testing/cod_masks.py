"""The P-EAGLE mask of a flat COD row built from document lengths in one call, for tests.

Training never builds these: loader workers compute the block indices (``cod_block_indices``) and
ship each element's document id with the batch, and the trainer builds the ``mask_mod``
(``peagle_mask_mod``) and the BlockMask (``block_mask_from_indices``) from them on the device
(docs/mask.md). Tests compare those with what flex's own ``create_block_mask`` and the dense rule
give for rows they lay out by hand, and these two functions save them the plumbing.

Shape letters: N flat COD elements, D documents.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from peagle.model.mask import MaskMod, block_mask_from_indices, cod_block_indices, document_ids, peagle_mask_mod
from peagle.schemas.loader_config import DEFAULT_BLOCK_SIZE


def create_peagle_mask_mod(anchor_pos: Tensor, depth: Tensor, lengths: Tensor, total_seq_len: int) -> MaskMod:
    """The flex_attention ``mask_mod`` of the P-EAGLE rule from document lengths.

    ``anchor_pos``/``depth`` are ``[N]`` per flat element (anchors are row offsets), ``lengths`` is
    ``[D]`` document lengths in the same coordinates, ``total_seq_len`` the padded row length. The
    closure reads tensors on ``anchor_pos``'s device, so build it where attention runs. The rule does
    not depend on the element order; only :func:`cod_block_mask` needs the flat COD layout.
    """
    anchor_N = torch.as_tensor(anchor_pos, dtype=torch.long)
    depth_N = torch.as_tensor(depth, dtype=torch.long).to(anchor_N.device)
    return peagle_mask_mod(anchor_N, depth_N, document_ids(anchor_N, lengths, total_seq_len))


def cod_block_mask(anchor_pos: Tensor, depth: Tensor, lengths: Tensor, total_seq_len: int, *,
                   block_size: int = DEFAULT_BLOCK_SIZE, device: torch.device | str | None = None) -> BlockMask:
    """BlockMask of a flat COD row, equal to ``create_block_mask(mask_mod, None, None, N, N)`` (docs/performance.md).

    Indices come from ``cod_block_indices`` on the CPU (the loader workers' half); the mask_mod is built
    on ``device`` (default: ``anchor_pos``'s device).
    """
    device = torch.as_tensor(anchor_pos).device if device is None else torch.device(device)
    indices = cod_block_indices(anchor_pos, depth, lengths, total_seq_len, block_size=block_size)
    mask_mod = create_peagle_mask_mod(
        torch.as_tensor(anchor_pos).to(device), torch.as_tensor(depth).to(device),
        torch.as_tensor(lengths), total_seq_len)
    return block_mask_from_indices(indices, mask_mod, device=device)


__all__ = ["cod_block_mask", "create_peagle_mask_mod"]
