"""The draft's mask token at training time: the one `peagle extract` chose and recorded in the store.

Stores written before extract recorded a choice have none; for them ``--mask-token-id`` names one,
which is then checked against every stored token (a mask slot must never look like real data).
"""

from __future__ import annotations

import pyarrow.compute as pc

from peagle.pipeline.shard_parquet import read_shard_rows
from peagle.pipeline.store import Store
from peagle.schemas.errors import UserError


def resolve_mask_token_id(stores: list[Store], asked: int | None) -> int:
    """The draft's mask token: the one extract chose and recorded in the stores.

    ``asked`` (``--mask-token-id``) must equal it; it is only needed for a store written before
    extract recorded a choice, and is then checked against every stored ``input_ids`` (one pass over
    the token columns) and the target's vocab.

    Raises:
        UserError: ``asked`` differs from the store's, no id is known, or ``asked`` is outside the
            target vocab or occurs in the data.
    """
    settings = stores[0].settings
    recorded = settings.mask_token_id
    if recorded is not None:
        if asked is not None and asked != recorded:
            raise UserError(f"--mask-token-id {asked} differs from the mask token {recorded} that store "
                            f"{stores[0].root} was extracted with (its data is checked against that one); "
                            "leave --mask-token-id out")
        return int(recorded)
    if asked is None:
        raise UserError(f"store {stores[0].root} records no mask token (written by an older peagle); pass "
                        "--mask-token-id N with an id the data never uses (e.g. a reserved special token), "
                        "or re-extract it")
    if not 0 <= asked < settings.target.vocab_size:
        raise UserError(f"--mask-token-id {asked} is outside the target vocab (ids 0..{settings.target.vocab_size - 1})")
    for store in stores:
        for record in store.shards:
            ids = read_shard_rows(store, record.index, ["input_ids"]).column("input_ids")
            if pc.any(pc.equal(pc.list_flatten(ids), asked)).as_py():
                raise UserError(f"--mask-token-id {asked} occurs in the data (store {store.root}, shard "
                                f"{record.index}); choose an id the data never uses")
    return int(asked)
