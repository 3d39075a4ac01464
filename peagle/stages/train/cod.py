"""COD (conditional-on-distribution) sampling: which draft elements one sample contributes (docs/cod.md).

P-EAGLE trains all K draft depths in one forward over a *flat* sequence. Depth 0 holds every
training position (the real tokens); depth d >= 1 holds masked elements that continue a chain of
d − 1 masked predictions started at ``anchor_pos``. Keeping every chain at every depth would make
the flat sequence K·L long, so deeper depths are subsampled with geometric decay.

Coordinates are per sample (docs/indexing.md): ``seq_length`` = the sample's n − 1 training positions and
``loss_mask`` is the *shifted* supervision mask ``m[p] = loss_mask_tokens[p + 2]``. An element of
depth d at reference position p has ``anchor_pos = p − d`` and RoPE position p.

Worked example (the seeds' one document of length 6): ``seq_length = 6``, ``m = [1, 1, 1, 1, 1, 1]``,
``num_depths = 4``, ``r = 0.8``, ``r_min = 0.2``; n_valid = 6, so the counts are
depth 1: int(5·0.8) = 4, depth 2: int(4·0.64) = 2, depth 3: int(3·0.512) = 1. One possible draw:

* depth 0: positions 0..5                        -> anchors [0, 1, 2, 3, 4, 5]
* depth 1: pool {1..5} (p >= 1), draws {1, 2, 4, 5} -> anchors [0, 1, 3, 4]
* depth 2: pool = {p : p − 1 drawn at depth 1, m[p]} = {2, 3, 5} (6 is past the end), draws {2, 5}
                                                  -> anchors [0, 3]
* depth 3: pool {3} (p = 6 is past the end), int(1.536) = 1 -> anchors [0]

giving ``anchor_pos = [0,1,2,3,4,5, 0,1,3,4, 0,3, 0]`` and ``depth = [0,0,0,0,0,0, 1,1,1,1, 2,2, 3]``.

Randomness comes only from the ``generator`` argument; :func:`cod_generator` seeds one from
(run seed, epoch, sample_id), so a sample gets the same draw on any rank, worker or resume.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from peagle.schemas.cod_settings import CodSettings
from peagle.stages.train.seeds import stable_seed

_DEFAULT = CodSettings()
"""Where the functions below take their defaults: the settings' own, written once (cod_settings.py)."""


def cod_depth_counts(n_valid: int, num_depths: int, down_sample_ratio: float = _DEFAULT.down_sample_ratio,
                     down_sample_ratio_min: float = _DEFAULT.down_sample_ratio_min,
                     max_anchors: int | None = _DEFAULT.max_anchors) -> list[int]:
    """Target sample count of each depth 1..num_depths−1 (before clipping to the candidate pool).

    ``int((n_valid − d) · max(r^d, r_min))``, never negative. With ``max_anchors = M`` and a depth-1
    count above M, depth 1 takes M and every deeper count is scaled by the same factor (M / the
    depth-1 count), so the decay profile across depths stays that of the uncapped draw.
    """
    raw = [max(0.0, (n_valid - d) * max(down_sample_ratio ** d, down_sample_ratio_min))
           for d in range(1, num_depths)]
    if max_anchors is not None and raw and int(raw[0]) > max_anchors:
        scale = max_anchors / raw[0]
        return [max_anchors] + [int(x * scale) for x in raw[1:]]
    return [int(x) for x in raw]


def _sample_without_replacement(pool: Tensor, count: int, generator: torch.Generator | None) -> Tensor:
    """``count`` elements of ``pool`` drawn without replacement, position-sorted; all when fewer."""
    if count >= pool.numel():
        return pool
    picked = torch.randperm(pool.numel(), generator=generator)[:count]
    return pool[picked].sort().values


def generate_cod_sample_indices(
    seq_length: int,
    loss_mask: Tensor,
    num_depths: int = _DEFAULT.num_depths,
    down_sample_ratio: float = _DEFAULT.down_sample_ratio,
    down_sample_ratio_min: float = _DEFAULT.down_sample_ratio_min,
    filter_position_zero: bool = True,
    *,
    generator: torch.Generator | None = None,
    max_anchors: int | None = _DEFAULT.max_anchors,
) -> tuple[Tensor, Tensor]:
    """COD-sample the elements of one sample; returns ``(anchor_pos, depth)``, int64, flat COD layout.

    Algorithm (docs/cod.md; worked example in the module docstring), with ``m = loss_mask`` the
    shifted mask of length ``seq_length`` and ``n_valid = m.sum()``:

    1. depth 0 keeps every position 0..seq_length−1;
    2. depth 1 draws from the supervised positions p >= 1 (``filter_position_zero``), so that its
       anchor p − 1 is never negative;
    3. depth d >= 2 draws from the positions p with p − 1 drawn at depth d − 1 and ``m[p] = 1``:
       one step further along an already drawn chain, still supervised;
    4. depth d takes ``cod_depth_counts(...)[d − 1]`` positions without replacement, or its whole pool
       when that is smaller; once a depth is empty all deeper ones are too.

    Output is grouped by depth and position-sorted within a depth; element depth d at position p
    has ``anchor_pos = p − d``. So every depth-d element's chain is complete: (anchor, d − 1) exists.

    Args:
        seq_length: the sample's number of training positions (n − 1 for n tokens).
        loss_mask: shifted supervision mask ``[seq_length]`` (or ``[1, seq_length]``), bool or 0/1.
        num_depths: K, the number of depths including depth 0 (depths 0..K−1).
        down_sample_ratio: geometric decay r in (0, 1].
        down_sample_ratio_min: floor of the retention ratio.
        filter_position_zero: drop p = 0 from the depth-1 pool. Only False when ``m[0] == 0``.
        generator: the only source of randomness (see :func:`cod_generator`).
        max_anchors: cap M on this sample's chains: at most M distinct anchors carry depth >= 1
            elements (depth 1 draws at most M positions, and every deeper element extends a
            depth-1 chain); deeper counts shrink in proportion (:func:`cod_depth_counts`). Bounds
            the sample's flat length by ``seq_length + M · (num_depths − 1)``. None = no cap.

    Raises:
        ValueError: on a mask of the wrong length, bad ratios, or a supervised position 0 with
            ``filter_position_zero=False`` (its anchor would be −1).
    """
    m_L = torch.as_tensor(loss_mask).reshape(-1).to(torch.bool).cpu()
    if m_L.numel() != seq_length:
        raise ValueError(f"loss_mask has {m_L.numel()} positions, seq_length is {seq_length}")
    if num_depths < 1 or not 0.0 < down_sample_ratio <= 1.0 or down_sample_ratio_min < 0.0:
        raise ValueError(f"bad COD settings: num_depths={num_depths}, ratio={down_sample_ratio}, "
                         f"ratio_min={down_sample_ratio_min}")
    if max_anchors is not None and max_anchors < 0:
        raise ValueError(f"max_anchors must be >= 0, got {max_anchors}")
    if not filter_position_zero and seq_length > 0 and bool(m_L[0]):
        raise ValueError("position 0 is supervised but filter_position_zero=False: its anchor would be -1")

    counts = cod_depth_counts(int(m_L.sum()), num_depths, down_sample_ratio, down_sample_ratio_min, max_anchors)
    return _draw_chains(m_L, counts, filter_position_zero,
                        lambda pool_P, count: _sample_without_replacement(pool_P, count, generator))


def every_chain(seq_length: int, loss_mask: Tensor, num_depths: int) -> tuple[Tensor, Tensor]:
    """Every element COD's pools hold, nothing drawn: ``(anchor_pos, depth)`` in flat COD layout.

    Depth 0 is every position; depth d >= 1 every supervised p >= d whose chain p − d + 1 .. p is
    supervised (the pools of :func:`generate_cod_sample_indices`, taken whole). EAGLE-3's
    training-time test trains each of these chains at every depth (docs/methods.md); chains that
    would leave the supervised positions stop there, as COD's do. Deterministic: no generator.

    Raises:
        ValueError: on a mask of the wrong length or ``num_depths < 1``.
    """
    m_L = torch.as_tensor(loss_mask).reshape(-1).to(torch.bool).cpu()
    if m_L.numel() != seq_length:
        raise ValueError(f"loss_mask has {m_L.numel()} positions, seq_length is {seq_length}")
    if num_depths < 1:
        raise ValueError(f"num_depths must be >= 1, got {num_depths}")
    return _draw_chains(m_L, [seq_length] * (num_depths - 1), True, lambda pool_P, count: pool_P)


def _draw_chains(m_L: Tensor, counts: list[int], filter_position_zero: bool,
                 take: Callable[[Tensor, int], Tensor]) -> tuple[Tensor, Tensor]:
    """Depth 0 whole, then depth d = 1, 2, ... takes ``take(pool, counts[d - 1])`` of its pool (steps
    1-4 of :func:`generate_cod_sample_indices`); the first empty depth ends the chains."""
    seq_length = m_L.numel()
    anchors = [torch.arange(seq_length, dtype=torch.long)]
    depths = [torch.zeros(seq_length, dtype=torch.long)]
    supervised_P = torch.nonzero(m_L).flatten()
    drawn_P = torch.empty(0, dtype=torch.long)
    for d, count in enumerate(counts, start=1):
        if d == 1:
            pool_P = supervised_P[supervised_P >= 1] if filter_position_zero else supervised_P
        else:
            pool_P = drawn_P + 1
            pool_P = pool_P[pool_P < seq_length]
            pool_P = pool_P[m_L[pool_P]]
        drawn_P = take(pool_P, count)
        if drawn_P.numel() == 0:
            break
        anchors.append(drawn_P - d)
        depths.append(torch.full_like(drawn_P, d))
    return torch.cat(anchors), torch.cat(depths)


def cod_generator(run_seed: int, epoch: int, sample_id: str) -> torch.Generator:
    """A CPU generator seeded by a stable hash of (run seed, epoch, sample_id) (:func:`stable_seed`)."""
    return torch.Generator(device="cpu").manual_seed(stable_seed(int(run_seed), int(epoch), str(sample_id)))


def pack_cod(per_sample: list[tuple[Tensor, Tensor]], doc_starts: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """Merge the COD draws of samples packed into one row into the row's flat COD layout.

    Sample j's anchors are offset by ``doc_starts[j]`` (its first training position in the row);
    elements are then ordered by (depth, row anchor): all depth-0 elements of all samples, then all
    depth-1, ... -- the layout :func:`peagle.model.mask.cod_block_indices` expects.

    Returns:
        ``(anchor_pos, depth, position_ids)``, int64 ``[N]``: row anchors, depths, and RoPE positions
        ``anchor − doc_start + depth`` counted from the start of the element's own sample (docs/indexing.md).
    """
    if len(per_sample) != len(doc_starts):
        raise ValueError(f"{len(per_sample)} samples but {len(doc_starts)} doc starts")
    if not per_sample:
        empty = torch.empty(0, dtype=torch.long)
        return empty, empty.clone(), empty.clone()
    anchor_N = torch.cat([a.long() + int(start) for (a, _), start in zip(per_sample, doc_starts)])
    depth_N = torch.cat([d.long() for _, d in per_sample])
    position_N = torch.cat([a.long() + d.long() for a, d in per_sample])
    stride = int(anchor_N.max()) + 1 if anchor_N.numel() else 1
    order = torch.argsort(depth_N * stride + anchor_N, stable=True)
    return anchor_N[order], depth_N[order], position_N[order]
