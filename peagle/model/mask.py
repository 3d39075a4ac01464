"""The P-EAGLE attention rule over a flat COD sequence, as a flex ``mask_mod``, a dense mask and a BlockMask.

A training row is one *flat COD sequence*: every COD element (docs/cod.md) of every sample packed into
the row, laid out as depth groups in order (all depth-0 elements, then all depth-1, ...), sorted by
anchor inside each group. Element ``i`` carries ``anchor_pos[i]`` (the row offset where its chain
starts) and ``depth[i]``; its reference position is ``anchor_pos[i] + depth[i]``.

Visibility (docs/mask.md): query q may see key k iff both lie in the same document, q is not padding,
and either

* k is depth 0 and ``anchor_k <= anchor_q`` (the real context the draft has read), or
* k is in q's own chain: ``anchor_k == anchor_q`` and ``depth_k <= depth_q``.

Documents come from ``lengths``: document j covers anchors ``[sum(lengths[:j]), sum(lengths[:j+1]))``;
anchors at or after ``sum(lengths)`` (up to ``total_seq_len``) are padding (document id -1).

Three consumers, one rule:

* :func:`peagle_mask_mod` -- the ``mask_mod`` closure that flex_attention evaluates;
* :func:`dense_mask` -- ``[N, N]`` bool for SDPA (:func:`dense_peagle_mask` from lengths);
* :func:`document_masks` -- the same rule per document (:class:`DocumentMasks`): no element sees
  another document, so SDPA over each document's elements alone computes the same attention at
  ``sum(n_d^2)`` instead of ``N^2`` (the CPU training path, where attention is dense);
* a BlockMask built from metadata in O(N·K + blocks²) instead of evaluating the mask_mod on every
  block pair (docs/performance.md): :func:`cod_block_indices` computes it on the CPU, in DataLoader
  workers, and :func:`block_mask_from_indices` wraps it on the device, in the trainer
  (``peagle.testing.cod_masks`` has both halves in one call, and the mask_mod from document lengths,
  for tests).

Shape letters: N = flat COD elements in the row, D = documents, L = ``total_seq_len`` (original-token
row length), Qb/KVb = query/key blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Callable, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from peagle.schemas.loader_config import DEFAULT_BLOCK_SIZE  # the loader computes block indices for it

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def document_ids(anchor_pos_N: Tensor, lengths_D: Tensor, total_seq_len: int) -> Tensor:
    """Document id of every element (-1 for padding), looked up through its anchor.

    Raises:
        ValueError: when the lengths overflow the row or an anchor lies outside ``[0, total_seq_len)``.
    """
    lengths_D = torch.as_tensor(lengths_D, dtype=torch.long).flatten().cpu()
    anchor_pos_N = torch.as_tensor(anchor_pos_N, dtype=torch.long)
    if int(lengths_D.sum()) > total_seq_len or bool((lengths_D < 0).any()):
        raise ValueError(f"document lengths {lengths_D.tolist()} do not fit total_seq_len {total_seq_len}")
    if anchor_pos_N.numel() and (int(anchor_pos_N.min()) < 0 or int(anchor_pos_N.max()) >= total_seq_len):
        raise ValueError(
            f"anchors must lie in [0, {total_seq_len}); got [{int(anchor_pos_N.min())}, {int(anchor_pos_N.max())}]"
        )
    doc_of_pos_L = torch.full((total_seq_len,), -1, dtype=torch.long)
    doc_of_pos_L[: int(lengths_D.sum())] = torch.repeat_interleave(torch.arange(lengths_D.numel()), lengths_D)
    return doc_of_pos_L.to(anchor_pos_N.device)[anchor_pos_N]


def peagle_mask_mod(anchor_N: Tensor, depth_N: Tensor, doc_N: Tensor, rows: slice | None = None) -> MaskMod:
    """The flex_attention ``mask_mod(b, h, q_idx, kv_idx)`` of the P-EAGLE rule from per-element metadata.

    ``doc_N`` is each element's document id (-1: padding), as :func:`document_ids` computes it; the
    trainer receives it with the batch from the loader workers, so building this closure on the GPU
    reads nothing back to the host. All three tensors must live where attention runs.

    ``rows`` (a slice with host bounds) makes the queries elements ``rows`` only, the keys elements
    ``0 .. rows.stop - 1``: one step of sequential drafting, whose queries are one depth group and
    whose keys are every element up to it (:func:`cod_block_indices` with the same ``rows``). The
    query side reads views of the metadata, so the offset is never a traced constant.
    """
    anchor_Q, depth_Q, doc_Q = (anchor_N, depth_N, doc_N) if rows is None else (anchor_N[rows], depth_N[rows],
                                                                                doc_N[rows])

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        doc_q, doc_k = doc_Q[q_idx], doc_N[kv_idx]
        anchor_q, anchor_k = anchor_Q[q_idx], anchor_N[kv_idx]
        depth_q, depth_k = depth_Q[q_idx], depth_N[kv_idx]
        real_context = (depth_k == 0) & (anchor_k <= anchor_q)
        own_chain = (anchor_k == anchor_q) & (depth_k <= depth_q)
        return (doc_q == doc_k) & (doc_q >= 0) & (real_context | own_chain)

    return mask_mod


def dense_mask(anchor_N: Tensor, depth_N: Tensor, doc_N: Tensor, rows: slice | None = None) -> Tensor:
    """The rule as ``[N, N]`` bool (True = may attend) for SDPA; equals evaluating :func:`peagle_mask_mod`.
    With ``rows`` (see there) it is ``[len(rows), rows.stop]``: those queries over the keys up to them.

    Device ops only (no host read), so the trainer can build it from shipped metadata without a sync.
    """
    num_keys = anchor_N.numel() if rows is None else rows.stop
    idx_K = torch.arange(num_keys, device=anchor_N.device)
    idx_Q = idx_K if rows is None else idx_K[rows]
    return peagle_mask_mod(anchor_N, depth_N, doc_N)(None, None, idx_Q[:, None], idx_K[None, :])


@dataclass(frozen=True)
class DocumentMasks:
    """The P-EAGLE mask of a flat row as one dense mask per document.

    ``index_per_doc[d]`` lists the query rows of document d (ascending); ``mask_per_doc[d]`` is the
    rule over them and the document's keys, ``key_index_per_doc[d]`` (None: the same rows as the
    queries), ``[n_d, m_d]``. Elements outside every document (doc -1, padding) see nothing and are
    in no list: attention leaves zeros there. Built on the host from the element metadata, so it is
    for the CPU path (the GPU trains with flex and a BlockMask).
    """

    index_per_doc: list[Tensor]
    mask_per_doc: list[Tensor]
    num_elements: int
    key_index_per_doc: list[Tensor] | None = None


def document_masks(anchor_N: Tensor, depth_N: Tensor, doc_N: Tensor, rows: slice | None = None) -> DocumentMasks:
    """:func:`dense_mask` split by document (:class:`DocumentMasks`); with ``rows`` the queries are those
    rows (indexed from ``rows.start``) and the keys the elements before ``rows.stop``."""
    if rows is None:
        order = torch.argsort(doc_N, stable=True)
        docs, counts = torch.unique_consecutive(doc_N[order], return_counts=True)
        index_per_doc, mask_per_doc = [], []
        for doc, idx in zip(docs.tolist(), torch.split(order, counts.tolist())):
            if doc < 0:
                continue
            index_per_doc.append(idx)
            mask_per_doc.append(dense_mask(anchor_N[idx], depth_N[idx], doc_N[idx]))
        return DocumentMasks(index_per_doc, mask_per_doc, int(anchor_N.numel()))
    doc_Q, doc_K = doc_N[rows], doc_N[: rows.stop]
    rule = peagle_mask_mod(anchor_N, depth_N, doc_N)
    index_per_doc, key_index_per_doc, mask_per_doc = [], [], []
    for doc in torch.unique(doc_Q).tolist():
        if doc < 0:
            continue
        idx_q, idx_k = torch.nonzero(doc_Q == doc).flatten(), torch.nonzero(doc_K == doc).flatten()
        index_per_doc.append(idx_q)
        key_index_per_doc.append(idx_k)
        mask_per_doc.append(rule(None, None, (idx_q + rows.start)[:, None], idx_k[None, :]))
    return DocumentMasks(index_per_doc, mask_per_doc, int(doc_Q.numel()), key_index_per_doc)


def dense_peagle_mask(anchor_pos: Tensor, depth: Tensor, lengths: Tensor, total_seq_len: int) -> Tensor:
    """The same rule as ``[N, N]`` bool (True = may attend), for SDPA: the mask_mod itself, evaluated on
    every (query, key) pair at once by broadcasting."""
    anchor_N = torch.as_tensor(anchor_pos, dtype=torch.long)
    depth_N = torch.as_tensor(depth, dtype=torch.long).to(anchor_N.device)
    return dense_mask(anchor_N, depth_N, document_ids(anchor_N, lengths, total_seq_len))


class CodBlockIndices(NamedTuple):
    """The block-sparse structure of one row, as ``create_block_mask`` would return it (B = H = 1).

    Tensors are int32: ``kv_num_blocks`` ``[1, 1, Qb]`` and ``kv_indices`` ``[1, 1, Qb, KVb]`` for
    partial blocks (mask_mod evaluated), ``full_*`` for blocks every (q, k) pair of which is visible.
    ``seq_len`` queries over ``kv_seq_len`` keys (None: as many keys as queries).
    """

    kv_num_blocks: Tensor
    kv_indices: Tensor
    full_kv_num_blocks: Tensor
    full_kv_indices: Tensor
    seq_len: int
    block_size: int
    kv_seq_len: int | None = None


def _merged_visible_runs(anchor_N: Tensor, depth_N: Tensor, doc_N: Tensor, doc_start_D: Tensor,
                         total_seq_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """Visible keys of every real query as disjoint runs ``[lo, hi)`` over the *real* elements.

    Real elements (doc >= 0), in flat order, are sorted by the key ``depth·(L+1) + anchor``. A query at
    (doc d, anchor a, depth e) sees the depth-0 run ``[doc_start_d, a]`` and, for each 1 <= j <= e,
    the depth-j run of anchor a: at most K+1 searchsorted runs per query, in increasing order. Runs
    that touch are merged, so that a key block covered by two adjacent runs counts as covered.
    Returns ``(query_R, lo_R, hi_R)``, one row per merged non-empty run, indices into the real list.
    """
    real_N = doc_N >= 0
    key_stride = total_seq_len + 1
    key_R = (depth_N[real_N] * key_stride + anchor_N[real_N]).contiguous()
    if key_R.numel() > 1 and bool((key_R[1:] < key_R[:-1]).any()):
        raise ValueError("cod_block_indices needs the flat COD layout: depth groups in order, anchors sorted inside")
    anchor_Q, depth_Q, doc_Q = anchor_N[real_N], depth_N[real_N], doc_N[real_N]
    max_depth = int(depth_Q.max()) if key_R.numel() else 0

    # The current (open) run of each still-active query; a query leaves after its own depth.
    active_A = torch.arange(key_R.numel())
    cur_lo_A = torch.searchsorted(key_R, doc_start_D[doc_Q], right=False)
    cur_hi_A = torch.searchsorted(key_R, anchor_Q, right=True)
    out_q, out_lo, out_hi = [], [], []

    def emit(keep: Tensor) -> None:
        keep = keep & (cur_hi_A > cur_lo_A)
        out_q.append(active_A[keep]), out_lo.append(cur_lo_A[keep]), out_hi.append(cur_hi_A[keep])

    for j in range(1, max_depth + 1):
        stays = depth_Q[active_A] >= j
        emit(~stays)
        active_A, cur_lo_A, cur_hi_A = active_A[stays], cur_lo_A[stays], cur_hi_A[stays]
        probe_A = j * key_stride + anchor_Q[active_A]
        lo_A = torch.searchsorted(key_R, probe_A, right=False)
        hi_A = torch.searchsorted(key_R, probe_A, right=True)
        nonempty = hi_A > lo_A
        extend = nonempty & (lo_A == cur_hi_A) & (cur_hi_A > cur_lo_A)
        restart = nonempty & ~extend
        emit(restart)
        cur_lo_A = torch.where(restart, lo_A, cur_lo_A)
        cur_hi_A = torch.where(nonempty, hi_A, cur_hi_A)
    emit(torch.ones_like(active_A, dtype=torch.bool))
    return torch.cat(out_q), torch.cat(out_lo), torch.cat(out_hi)


def _ordered(blocks_QK: Tensor) -> tuple[Tensor, Tensor]:
    """Block-row counts and column indices in create_block_mask's order (set columns first, ascending)."""
    as_int = blocks_QK.to(torch.int32)
    indices = torch.argsort(as_int, dim=-1, descending=True, stable=True).to(torch.int32)
    return as_int.sum(dim=-1, dtype=torch.int32)[None, None], indices[None, None].contiguous()


def cod_block_indices(anchor_pos: Tensor, depth: Tensor, lengths: Tensor, total_seq_len: int, *,
                      block_size: int = DEFAULT_BLOCK_SIZE, rows: slice | None = None) -> CodBlockIndices:
    """Compute the BlockMask index arrays of a flat COD row on the CPU, without the mask_mod.

    Layout contract: the real elements (anchor inside a document), taken in flat order, are sorted by
    (depth, anchor); padding elements may sit anywhere (they see nothing and nobody sees them), e.g.
    appended at the end to bring N to a common size. Every query's visible keys are then at most K+1
    contiguous runs of real elements (module docstring). A (query block, key block) pair is *partial*
    if some query sees some key in it, *full* if all ``block_size²`` pairs are visible (blocks that
    stick out past N are never full, as in ``create_block_mask``, which pads with False). Both are
    counted with difference arrays over runs: O(N·K + Qb·KVb), against create_block_mask's O(N²).

    ``rows`` (host bounds) restricts the queries to those elements, counted from ``rows.start``, and
    the keys to the elements before ``rows.stop`` (one step of sequential drafting: a depth group over
    every element up to it, :func:`peagle_mask_mod` with the same ``rows``).

    Raises:
        ValueError: when the real elements are not in the flat COD layout, or metadata do not fit.
    """
    anchor_N = torch.as_tensor(anchor_pos, dtype=torch.long).flatten().cpu()
    depth_N = torch.as_tensor(depth, dtype=torch.long).flatten().cpu()
    lengths_D = torch.as_tensor(lengths, dtype=torch.long).flatten().cpu()
    num_elements = anchor_N.numel()
    rows = slice(0, num_elements) if rows is None else rows
    doc_N = document_ids(anchor_N, lengths_D, total_seq_len)
    doc_start_D = torch.cumsum(lengths_D, 0) - lengths_D
    num_queries, num_keys = rows.stop - rows.start, rows.stop
    num_q_blocks, num_kv_blocks = -(-num_queries // block_size), -(-num_keys // block_size)

    real_N = doc_N >= 0
    flat_of_real = torch.nonzero(real_N).flatten()
    query_R, lo_R, hi_R = _merged_visible_runs(anchor_N, depth_N, doc_N, doc_start_D, total_seq_len)
    query_flat_R = flat_of_real[query_R]
    asked = (query_flat_R >= rows.start) & (query_flat_R < rows.stop)
    query_block_R = (query_flat_R[asked] - rows.start) // block_size
    first_flat_R = flat_of_real[lo_R[asked]]
    last_flat_R = flat_of_real[hi_R[asked] - 1]
    if last_flat_R.numel() and int(last_flat_R.max()) >= num_keys:
        raise ValueError(f"cod_block_indices: queries {rows.start}..{rows.stop - 1} see keys past {rows.stop - 1}")

    # Key blocks holding at least one real element of the run: those between the run's first and last
    # flat index that hold any real element (padding in between hides nothing it should not).
    reach_QK = torch.zeros((num_q_blocks, num_kv_blocks + 1), dtype=torch.int32)
    ones = torch.ones_like(query_block_R, dtype=torch.int32)
    reach_QK.index_put_((query_block_R, first_flat_R // block_size), ones, accumulate=True)
    reach_QK.index_put_((query_block_R, last_flat_R // block_size + 1), -ones, accumulate=True)
    real_per_block = torch.zeros(num_kv_blocks, dtype=torch.long).index_add_(
        0, torch.arange(num_keys) // block_size, real_N[:num_keys].long())
    any_QK = (reach_QK.cumsum(dim=-1)[:, :num_kv_blocks] > 0) & (real_per_block > 0)[None, :]

    # Key blocks lying wholly inside the run, counted per query block; full when all block_size
    # queries of the block cover it and the block holds no padding element.
    first_full_R = -(-first_flat_R // block_size)
    end_full_R = (last_flat_R + 1) // block_size
    has_full = end_full_R > first_full_R
    cover_QK = torch.zeros((num_q_blocks, num_kv_blocks + 1), dtype=torch.int32)
    ones = torch.ones(int(has_full.sum()), dtype=torch.int32)
    cover_QK.index_put_((query_block_R[has_full], first_full_R[has_full]), ones, accumulate=True)
    cover_QK.index_put_((query_block_R[has_full], end_full_R[has_full]), -ones, accumulate=True)
    block_all_real = real_per_block == block_size
    full_QK = (cover_QK.cumsum(dim=-1)[:, :num_kv_blocks] == block_size) & block_all_real[None, :]

    kv_num_blocks, kv_indices = _ordered(any_QK & ~full_QK)
    full_kv_num_blocks, full_kv_indices = _ordered(full_QK)
    return CodBlockIndices(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, num_queries, block_size,
                           None if num_keys == num_queries else num_keys)


def block_mask_from_indices(indices: CodBlockIndices, mask_mod: MaskMod, *,
                            device: torch.device | str | None = None) -> BlockMask:
    """Wrap precomputed indices (e.g. from a DataLoader worker) into a BlockMask on ``device``.

    ``mask_mod`` must be the row's :func:`peagle_mask_mod`, built on the same device. The trainer
    passes indices that are already on the device (copied non-blocking with the batch), so the
    ``.to`` calls here are no-ops there; given CPU indices they copy (and wait).
    """
    return BlockMask.from_kv_blocks(
        indices.kv_num_blocks.to(device),
        indices.kv_indices.to(device),
        indices.full_kv_num_blocks.to(device),
        indices.full_kv_indices.to(device),
        BLOCK_SIZE=(indices.block_size, indices.block_size),
        mask_mod=mask_mod,
        seq_lengths=(indices.seq_len, indices.kv_seq_len or indices.seq_len),
    )
