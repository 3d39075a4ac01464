"""The mask token training uses: the store's recorded choice, or for an older store one that is
checked against all its data."""

from __future__ import annotations

import json
import shutil

import pytest

from peagle.pipeline.store import open_store
from peagle.schemas.errors import UserError
from peagle.stages.train.mask_token import resolve_mask_token_id


def _older_store(tiny_store, tmp_path, mask_token_id=None):
    """A copy of the store as an older peagle wrote it: no mask token choice in store.json."""
    root = tmp_path / "older"
    shutil.copytree(tiny_store.root, root, ignore=shutil.ignore_patterns("vocab"))
    settings = json.loads((root / "store.json").read_text())
    del settings["mask_token"], settings["mask_token_source"]
    settings["mask_token_id"] = mask_token_id
    (root / "store.json").write_text(json.dumps(settings))
    return root


def test_the_mask_token_is_the_one_the_store_records(tiny_store):
    stores = [open_store(tiny_store.root)]
    assert resolve_mask_token_id(stores, None) == resolve_mask_token_id(stores, tiny_store.mask_token_id) \
        == tiny_store.mask_token_id
    with pytest.raises(UserError, match=f"--mask-token-id 3 differs from the mask token {tiny_store.mask_token_id}"):
        resolve_mask_token_id(stores, 3)


def test_an_older_store_needs_a_mask_token_the_data_never_uses(tiny_store, tmp_path):
    stores = [open_store(_older_store(tiny_store, tmp_path))]
    with pytest.raises(UserError, match="records no mask token .* pass --mask-token-id N"):
        resolve_mask_token_id(stores, None)
    used = {t for s in tiny_store.samples.values() for t in s.input_ids}
    unused = max(set(range(tiny_store.vocab_size)) - used)
    assert resolve_mask_token_id(stores, unused) == unused
    last_used = tiny_store.samples[tiny_store.order[-1]].input_ids[-1]  # in the last shard: the whole store is read
    with pytest.raises(UserError, match=f"--mask-token-id {last_used} occurs in the data"):
        resolve_mask_token_id(stores, last_used)
    with pytest.raises(UserError, match="outside the target vocab"):
        resolve_mask_token_id(stores, tiny_store.vocab_size)
