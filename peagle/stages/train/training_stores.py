"""Which stores one training run may read, and together: checked when the loader opens them.

**A store whose commit statistics show broken rows is refused** (all-zero or non-finite aux rows,
``ShardRecord.stats``), naming the shard and ``--allow-bad-aux-rows``; stores of different hidden
encodings (bf16 + fp8) are refused in one line, with the conversion command; stores of different
targets (hidden size, aux layers, vocab, top-k, mask token, tokenizer, target content) are refused
naming the field and both values; **an incomplete store** (planned shards not committed) is
refused naming the missing shards, unless ``allow_incomplete``.
"""

from __future__ import annotations

import logging
from typing import Any

from peagle.pipeline.plan import store_completeness
from peagle.pipeline.store import Store, open_store
from peagle.schemas import store as S
from peagle.schemas.errors import UserError, show_value
from peagle.schemas.loader_config import LoaderConfig

log = logging.getLogger(__name__)


def open_training_stores(config: LoaderConfig, *, growing: bool = False) -> list[Store]:
    """Open every store, check its aux layers against what the draft reads, every store against the
    first (whether a store fits the target is ``peagle.model.target.directory.check_store_matches_target``), and
    that each is complete (unless ``allow_incomplete``, or ``growing``: a store followed as it grows).

    Raises:
        UserError: one line naming the store, the field and both values; or the missing shards.
    """
    stores = [open_store(spec.path, verify=config.verify) for spec in config.stores]
    for store in stores:
        completeness = store_completeness(store.root, (r.index for r in store.shards))
        if not completeness.complete and not growing:
            if not config.allow_incomplete:
                raise UserError(completeness.refusal("train"))
            log.warning("%s", completeness.warning("training"))
    for store in stores:
        held = tuple(store.settings.aux_layer_ids)
        if config.aux_layer_ids is not None and held != tuple(config.aux_layer_ids):
            raise UserError(f"store {store.root} has aux_layer_ids {show_value(held)}, training asks for "
                            f"aux_layer_ids {show_value(config.aux_layer_ids)}")
    first = _store_facts(stores[0])
    for store in stores[1:]:
        encodings = (store.settings.hidden_dtype, stores[0].settings.hidden_dtype)
        if encodings[0] != encodings[1]:
            raise UserError(f"store {store.root} holds {encodings[0]} hidden states but store {stores[0].root} holds "
                            f"{encodings[1]}; one run reads one encoding: `peagle store convert --store {store.root} "
                            f"--hidden-dtype {encodings[1]} --out NEW` and train on NEW")
        held = _store_facts(store)
        for name, value in first.items():
            if held[name] != value:
                raise UserError(f"store {store.root} has {name} {show_value(held[name])} but store {stores[0].root} "
                                f"has {show_value(value)}; stores mixed in one run must come from one target")
    if not config.allow_bad_aux_rows:
        for store in stores:
            check_commit_stats(store)
    return stores


def check_commit_stats(store: Store) -> None:
    """Refuse a store whose commit statistics show all-zero or non-finite rows (records written before
    statistics existed have none, and pass).

    Raises:
        UserError: one line naming the store, the shard, the counts and the flag that overrides it.
    """
    for record in store.shards:
        stats = record.stats
        if stats is None or not (stats.zero_rows or stats.non_finite_rows):
            continue
        layers = [f"layer {layer_id}: {ls.zero_rows} all-zero, {ls.non_finite_rows} non-finite"
                  for layer_id, ls in zip(store.settings.aux_layer_ids, stats.layers)
                  if ls.zero_rows or ls.non_finite_rows]
        if stats.topk.non_finite_rows:
            layers.append(f"top-k: {stats.topk.non_finite_rows} non-finite")
        raise UserError(f"store {store.root} shard {S.shard_stem(record.index)} holds broken rows by its commit "
                        f"statistics ({'; '.join(layers)}): a draft trained on them learns garbage; "
                        f"`peagle store check --store {store.root}` names the samples, --allow-bad-aux-rows trains anyway")


def _store_facts(store: Store) -> dict[str, Any]:
    s = store.settings
    return {"hidden_size": s.target.hidden_size, "aux_layer_ids": tuple(s.aux_layer_ids),
            "vocab_size": s.target.vocab_size, "topk": s.topk, "mask_token_id": s.mask_token_id,
            "tokenizer_fingerprint": s.tokenizer_fingerprint, "target_content_hash": s.target.content_hash}
