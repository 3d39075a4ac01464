"""The conversion: a peagle store as the inputs of speculators 0.9.0's P-EAGLE training (benchmarks/peer_ab.py).

Runs in the speculators environment (``.venv-speculators``, with this repository on ``PYTHONPATH``):
it imports speculators' dataset base class and peagle's store reader, and nothing else of either.

**What speculators reads.** Its ``ArrowDataset`` (speculators/train/data.py) yields one dict per
sample, *unshifted*, row i describing token i:

==============================  ===================================  =========================================
speculators key                 meaning in speculators               taken from the peagle store (docs/store.md)
==============================  ===================================  =========================================
``input_ids`` [n]               x_0 … x_{n−1}                        ``input_ids``
``hidden_states`` [n, A·H]      aux states after reading x_0 … x_i    ``aux_hidden`` rows, the A layers concatenated
``loss_mask`` [n]               x_i is a token to learn               ``loss_mask``, cleared where row i has no target
``verifier_last_hidden_states``  target state after x_0 … x_i          the target's top-k of x_{i+1} as draft logits
==============================  ===================================  =========================================

Everything after that is speculators' own code: ``CollateFn`` packs samples into one row,
``shift_batch`` aligns them (position p reads x_{p+1} and aux row p, is charged by ``loss_mask[p+1]``
and learns the target row p+1; peagle charges by ``loss_mask[p+2]``, docs/indexing.md: that
difference is speculators' and is kept), its COD sampling, mask, model and loss.

**The targets.** speculators computes its targets inside ``PEagleDraftModel.forward`` as
``verifier_lm_head(verifier_norm(verifier_last_hidden_states))``: the target's logits over the draft
vocabulary. A peagle store keeps the target's top-k log-probs instead, and peagle trains on them
renormalised over the draft vocabulary. So that both trainers learn the same distribution, the
slot carries ``[n, V]`` logits (the row's top-k log-probs at their draft ids, the most negative
finite float elsewhere) and :func:`use_store_targets` makes those two modules identities: the
softmax over the draft vocabulary that speculators' KL takes is then exactly peagle's target. A
row none of whose top-k ids is in the draft vocabulary has no target (peagle drops that element):
its ``loss_mask`` is cleared (a finite fill keeps the masked row's loss finite, so 0 x loss is 0).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from speculators.train.data import BaseDataset
from speculators.train.vocab_mapping import save_token_frequency_distribution
from torch import nn

from peagle.pipeline.raw_reader import RawShard, read_raw_columns
from peagle.pipeline.shard_tensors import open_shard_tensors
from peagle.pipeline.store import open_store
from peagle.stages.train.vocab import load_draft_vocab

TARGET_FILL = torch.finfo(torch.float32).min
"""Draft logit of a draft id outside the row's top-k: probability exactly 0 after softmax."""


class StoreSamples(BaseDataset):
    """A peagle store's samples as speculators' dataset items (see the module docstring), read through
    peagle's raw reader (token index i, as stored: speculators shifts them itself).

    ``target_to_draft`` maps target ids to draft ids (−1 outside the draft vocabulary). ``max_len`` is
    speculators' packed row length (``--total-seq-len``), as its own datasets take it.
    """

    def __init__(self, store_path: str | Path, target_to_draft: torch.Tensor, draft_vocab_size: int, max_len: int,
                 hidden_states_dtype: torch.dtype = torch.float32):
        self.store = open_store(store_path)
        self.target_to_draft = target_to_draft.long()
        self.draft_vocab_size = draft_vocab_size
        self.columns = {record.index: read_raw_columns(self.store, record.index) for record in self.store.shards}
        self.refs = [(shard, row) for shard, columns in self.columns.items() for row in range(columns.num_samples)]
        self._shards: dict[int, RawShard] = {}  # tensors mapped when a sample of the shard is first asked for
        super().__init__(max_len, hidden_states_dtype)

    def __len__(self) -> int:
        return len(self.refs)

    def _compute_approx_lengths(self) -> list[int]:
        return [self.columns[shard].num_tokens(row) for shard, row in self.refs]

    def token_rows(self, index: int) -> dict[str, torch.Tensor]:
        """``input_ids`` and the stored ``loss_mask`` of sample ``index`` (what a frequency count reads)."""
        shard, row = self.refs[index]
        columns = self.columns[shard]
        tokens = slice(int(columns.offsets[row]), int(columns.offsets[row + 1]))
        return {"input_ids": torch.from_numpy(columns.input_ids[tokens].copy()),
                "loss_mask": torch.from_numpy(columns.loss_mask[tokens].copy())}

    def _get_raw_data(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self.refs):
            raise IndexError(index)
        shard, row = self.refs[index]
        if shard not in self._shards:
            self._shards[shard] = RawShard(shard, self.columns[shard], open_shard_tensors(self.store, shard))
        sample = self._shards[shard].sample(row)
        logits_nV, has_target_n = draft_logits(sample.topk_ids_nk, sample.topk_logprobs_nk, self.target_to_draft,
                                               self.draft_vocab_size)
        return {"hidden_states": sample.aux_nAH.reshape(sample.num_tokens, -1), "input_ids": sample.input_ids_n,
                "verifier_last_hidden_states": logits_nV, "loss_mask": sample.loss_mask_n & has_target_n}


def draft_logits(topk_ids_nk: torch.Tensor, topk_logprobs_nk: torch.Tensor, target_to_draft: torch.Tensor,
                 draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, V]`` fp32 logits holding each row's top-k log-probs at their draft ids (``TARGET_FILL``
    elsewhere), and ``[n]`` whether a row has any top-k id in the draft vocabulary."""
    draft_nk = target_to_draft[topk_ids_nk.long()]
    valid_nk = draft_nk >= 0
    logits = torch.full((draft_nk.shape[0], draft_vocab_size + 1), TARGET_FILL)
    # Ids outside the draft vocab write into a spare last column, dropped below.
    column_nk = torch.where(valid_nk, draft_nk, draft_vocab_size)
    logits.scatter_(1, column_nk, torch.where(valid_nk, topk_logprobs_nk.float(), TARGET_FILL))
    return logits[:, :draft_vocab_size].contiguous(), valid_nk.any(dim=1)


def use_store_targets(model: nn.Module) -> None:
    """Make ``verifier_lm_head(verifier_norm(x))`` return ``x``: the slot already holds target logits."""
    model.verifier_norm = nn.Identity()
    model.verifier_lm_head = nn.Identity()


def target_to_draft_of(t2d: torch.Tensor | None, target_vocab_size: int) -> torch.Tensor:
    """``[V_target]`` int64 draft id per target id (−1 outside), from a t2d mask (None: the identity)."""
    if t2d is None:
        return torch.arange(target_vocab_size, dtype=torch.long)
    t2d = t2d.bool()
    return torch.where(t2d, torch.cumsum(t2d.long(), 0) - 1, -1)


def write_token_frequencies(samples: StoreSamples, path: Path) -> None:
    """speculators' own token count (``save_token_frequency_distribution``: ``input_ids[loss_mask]``
    over the samples) into ``path``, where its vocab-mapping code looks for it."""
    save_token_frequency_distribution([samples.token_rows(i) for i in range(len(samples))], path)


def write_store_vocab(store_path: str | Path, draft_vocab_size: int, out_dir: Path) -> tuple[Path, Path]:
    """peagle's draft vocabulary of the store (``peagle vocab``) as the ``d2t``/``t2d`` .npy files
    speculators' ``--d2t-path``/``--t2d-path`` read."""
    vocab = load_draft_vocab(store_path, draft_vocab_size)
    if vocab.identity:
        raise ValueError(f"draft vocab {draft_vocab_size} of {store_path} is the whole target vocab: no mapping")
    out_dir.mkdir(parents=True, exist_ok=True)
    d2t, t2d = out_dir / f"d2t-{draft_vocab_size}.npy", out_dir / f"t2d-{draft_vocab_size}.npy"
    np.save(d2t, vocab.d2t_N.numpy())
    np.save(t2d, vocab.t2d_V.numpy())
    return d2t, t2d
