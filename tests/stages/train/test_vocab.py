"""Draft vocabulary: counts, selection, d2t/t2d and coverage against a slow obvious count."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from peagle.schemas.errors import UserError
from peagle.stages.train.vocab import build_draft_vocab, load_draft_vocab, select_draft_ids


def slow_counts(store) -> Counter:
    """Tokens x_i with loss_mask[i] = 1 and i >= 2 (the ones the draft is charged for), one by one."""
    counts = Counter()
    for s in store.samples.values():
        for i, (tok, m) in enumerate(zip(s.input_ids, s.loss_mask)):
            if m and i >= 2:
                counts[tok] += 1
    return counts


def test_vocab_matches_slow_count(tiny_store):
    n = 60
    vocab = build_draft_vocab(tiny_store.root, n)
    counts = slow_counts(tiny_store)
    assert vocab.counts_V.tolist() == [counts.get(i, 0) for i in range(tiny_store.vocab_size)]

    candidates = [i for i in range(tiny_store.vocab_size) if i != tiny_store.mask_token_id]
    expected = sorted(sorted(candidates, key=lambda i: (-counts.get(i, 0), i))[:n])
    assert vocab.selected_ids_N.tolist() == expected
    assert vocab.d2t_N.dtype == torch.int64 and vocab.t2d_V.dtype == torch.bool
    assert vocab.d2t_N.tolist() == [t - i for i, t in enumerate(expected)]
    assert torch.nonzero(vocab.t2d_V).flatten().tolist() == expected
    total = sum(counts.values())
    assert vocab.num_supervised_tokens == total
    assert vocab.coverage == pytest.approx(sum(counts[i] for i in expected) / total)
    assert tiny_store.mask_token_id not in expected

    t2d = vocab.target_to_draft()
    assert t2d[torch.tensor(expected)].tolist() == list(range(n))
    assert int((t2d >= 0).sum()) == n

    info = json.loads((tiny_store.root / "vocab" / f"draft-{n}.json").read_text())
    assert info["draft_vocab_size"] == n and info["identity"] is False
    assert info["coverage"] == pytest.approx(vocab.coverage)
    loaded = load_draft_vocab(tiny_store.root, n)
    assert torch.equal(loaded.d2t_N, vocab.d2t_N) and torch.equal(loaded.t2d_V, vocab.t2d_V)
    assert torch.equal(loaded.counts_V, vocab.counts_V) and loaded.coverage == vocab.coverage


def test_identity_vocab_has_no_mapping(tiny_store):
    v = tiny_store.vocab_size
    vocab = build_draft_vocab(tiny_store.root, v)
    assert vocab.identity and vocab.d2t_N is None and vocab.t2d_V is None
    assert vocab.coverage == 1.0
    assert torch.equal(vocab.target_to_draft(), torch.arange(v))
    loaded = load_draft_vocab(tiny_store.root, v)
    assert loaded.identity and loaded.d2t_N is None
    assert json.loads((tiny_store.root / "vocab" / f"draft-{v}.json").read_text())["identity"] is True


def test_one_below_target_vocab_drops_exactly_the_mask_token(tiny_store):
    vocab = build_draft_vocab(tiny_store.root, tiny_store.vocab_size - 1)
    assert not vocab.identity
    assert set(range(tiny_store.vocab_size)) - set(vocab.selected_ids_N.tolist()) == {tiny_store.mask_token_id}


def test_mask_token_is_never_selected_even_when_most_frequent():
    counts = np.array([5, 1, 100, 3, 3, 0], dtype=np.int64)
    assert select_draft_ids(counts, 3, mask_token_id=2).tolist() == [0, 3, 4]  # tie 3/4 by count, then 1
    assert select_draft_ids(counts, 4, mask_token_id=2).tolist() == [0, 1, 3, 4]
    assert select_draft_ids(counts, 2, mask_token_id=None).tolist() == [0, 2]
    assert select_draft_ids(np.zeros(4, np.int64), 2, mask_token_id=0).tolist() == [1, 2]  # ties: lower id


@pytest.mark.parametrize("size", [0, 10**6])
def test_bad_sizes_are_one_line_errors(tiny_store, size):
    with pytest.raises(UserError) as err:
        build_draft_vocab(tiny_store.root, size)
    assert "\n" not in str(err.value) and str(size) in str(err.value)


def test_missing_vocab_names_the_command(tiny_store):
    with pytest.raises(UserError) as err:
        load_draft_vocab(tiny_store.root, 77)
    msg = str(err.value)
    assert "\n" not in msg and f"peagle vocab --store {tiny_store.root} --draft-vocab-size 77" in msg


def test_train_uses_the_one_built_vocab_and_asks_when_there_are_several(tiny_store, tmp_path):
    import shutil

    from peagle.stages.train.vocab import built_draft_vocab_sizes, choose_draft_vocab_size

    root = tmp_path / "store"
    shutil.copytree(tiny_store.root, root, ignore=shutil.ignore_patterns("vocab"))
    v = tiny_store.vocab_size
    assert choose_draft_vocab_size(root, None, v, default=32000) == (
        v, f"draft vocab: none built in {root}, so the whole target vocab ({v:,} tokens, no mapping)")
    assert choose_draft_vocab_size(root, None, v, default=100) == (100, None)  # load_draft_vocab names the command
    build_draft_vocab(root, 48)
    size, note = choose_draft_vocab_size(root, None, v, default=32000)
    assert size == 48 and "the one `peagle vocab` built" in note
    assert choose_draft_vocab_size(root, 200, v, default=32000) == (200, None)
    build_draft_vocab(root, 64)
    (root / "vocab" / "draft-80.json").write_text("{}")  # half-built (no tensors): not a vocab
    assert built_draft_vocab_sizes(root) == [48, 64]
    with pytest.raises(UserError, match="has draft vocabs of sizes 48, 64; pass --draft-vocab-size"):
        choose_draft_vocab_size(root, None, v, default=32000)


def _written_store(root, token_rows: list[list[int]], fingerprint: str = "t"):
    """A store written by the real shard writer with exactly these token rows (every token supervised)."""
    from peagle.model.target.backend import TargetOutput
    from peagle.pipeline.store import init_store
    from peagle.schemas import store as S
    from peagle.stages.extract.template import TokenizedSample
    from peagle.stages.extract.writer import ShardContent, write_and_commit

    target = S.TargetIdentity(path="/m", architecture="LlamaForCausalLM", num_hidden_layers=8, hidden_size=16,
                              vocab_size=64, dtype="float32", content_hash="c" * 64)
    settings = S.StoreSettings(target=target, tokenizer_fingerprint=fingerprint, chat_template_hash="h",
                               aux_layer_ids=(2, 4, 5), topk=4, max_seq_len=64, logprob_dtype="float16", loss_on="all")
    init_store(root, settings)
    samples = [TokenizedSample(sample_id=f"s{i}", source=f"a.jsonl:{i}", input_ids=ids, loss_mask=[1] * len(ids))
               for i, ids in enumerate(token_rows)]
    outputs = [TargetOutput(aux_TAH=torch.ones(len(ids), 3, 16, dtype=torch.bfloat16),
                            topk_ids_TK=torch.zeros(len(ids), 4, dtype=torch.int32),
                            topk_logprobs_TK=torch.zeros(len(ids), 4)) for ids in token_rows]
    write_and_commit(root, ShardContent(index=0, input_name="a.jsonl", first_record=0, end_record=len(token_rows),
                                        samples=samples, outputs=outputs, skipped={}, num_truncated=0, backend="hf"),
                     settings)
    return root


def test_heldout_coverage_ranks_by_the_store_and_counts_the_heldout_text(tmp_path):
    # Charged tokens (position >= 2): the store has 5 x3, 6 x2, 7 x1; the held-out text 5, 6, 8, 8.
    store = _written_store(tmp_path / "a", [[1, 1, 5, 5, 5, 6, 6, 7]])
    heldout = _written_store(tmp_path / "h", [[1, 1, 5, 6, 8, 8]])
    vocab = build_draft_vocab(store, 2, heldout_store=heldout)
    assert vocab.coverage == pytest.approx(5 / 6)
    h = vocab.heldout
    assert h["num_supervised_tokens"] == 4 and h["coverage"] == pytest.approx(0.5)
    # Sizes N/4..8N within the vocab: 1 -> {5}; 2 -> {5, 6}; 4 and 8 add 7 and the lowest unseen ids
    # (0, 1, ...), never 8; 16 reaches it.
    assert h["coverage_by_size"] == [[1, 0.25], [2, 0.5], [4, 0.5], [8, 0.5], [16, 1.0]]
    info = json.loads((store / "vocab" / "draft-2.json").read_text())
    assert info["heldout"] == h
    assert load_draft_vocab(store, 2).heldout == h
    build_draft_vocab(store, 3)  # without a held-out store, nothing is recorded of one
    assert "heldout" not in json.loads((store / "vocab" / "draft-3.json").read_text())


def test_heldout_store_of_another_tokenizer_is_refused_before_anything_is_written(tmp_path):
    store = _written_store(tmp_path / "a", [[1, 1, 5, 5, 6]])
    other = _written_store(tmp_path / "o", [[1, 1, 5, 6]], fingerprint="another")
    with pytest.raises(UserError, match="another tokenizer"):
        build_draft_vocab(store, 2, heldout_store=other)
    assert not (store / "vocab" / "draft-2.json").exists()
