"""The `peagle extract` command that finishes an incomplete store, from what the store records.

A store records the settings every extraction into it must repeat (``store.json``) and, per input
file, where it was first registered and how many records each of its shards holds
(``inputs/<sha256>.json``). From these the command is a pure function: one worker re-running it
extracts exactly the missing shards (committed ones are never redone), whichever worker died. The
data paths are those of the machine that first registered the files; on another machine the same
files under other paths do as well (a file is known by its content).
"""

from __future__ import annotations

import shlex
from itertools import groupby

from peagle.pipeline import plan as P
from peagle.pipeline.plan import Completeness
from peagle.schemas import store as S


def settings_flags(settings: S.StoreSettings) -> list[str]:
    """The flags that make `peagle extract` derive exactly ``settings`` (``store_settings``)."""
    flags = ["--aux-layers", ",".join(map(str, settings.aux_layer_ids)), "--topk", str(settings.topk),
             "--max-seq-len", str(settings.max_seq_len), "--dtype", settings.target.dtype,
             "--logprob-dtype", settings.logprob_dtype, "--loss-on", settings.loss_on,
             "--hidden-dtype", settings.hidden_dtype]
    if not settings.supervise_reasoning:
        flags.append("--no-supervise-reasoning")
    if settings.mask_token_source == S.MASK_FROM_FLAG:
        flags += ["--mask-token-id", str(settings.mask_token_id)]
    if settings.regenerate:
        r = settings.regenerate
        flags += ["--regenerate", "--temperature", str(r["temperature"]), "--top-p", str(r["top_p"]),
                  "--max-new-tokens", str(r["max_new_tokens"]), "--seed", str(r["seed"])]
    return flags


def finish_commands(completeness: Completeness, settings: S.StoreSettings, backends: tuple[str, ...] = ()) -> list[str]:
    """One `peagle extract` command per records-per-shard value among the inputs with missing shards
    (one, unless the inputs were registered with different ``--samples-per-shard``); with the backend
    the committed shards were extracted with when they agree on one."""
    missing_inputs = {completeness.registration_of(s).sha256: completeness.registration_of(s)
                      for s in completeness.missing}
    return extract_commands(completeness, list(missing_inputs.values()), settings, backends)


def restart_commands(completeness: Completeness, settings: S.StoreSettings, backends: tuple[str, ...] = ()) -> list[str]:
    """The commands that extract every registered input: for a store none of whose shards holds a
    usable sample, which they start afresh once its cause (a chat template, the data) is mended."""
    return extract_commands(completeness, list(completeness.registrations), settings, backends)


def extract_commands(completeness: Completeness, registrations: list[P.InputRegistration], settings: S.StoreSettings,
                     backends: tuple[str, ...] = ()) -> list[str]:
    """The `peagle extract` commands of ``registrations`` into the store, grouped by records per shard."""
    by_size = sorted(registrations, key=lambda r: (r.records_per_shard, r.first_shard))
    commands = []
    for records_per_shard, group in groupby(by_size, key=lambda r: r.records_per_shard):
        data = [r.path or r.name for r in sorted(group, key=lambda r: r.first_shard)]
        args = ["peagle", "extract", "--data", *data, "--target", settings.target.path,
                "--out", str(completeness.root.absolute()), "--samples-per-shard", str(records_per_shard),
                *settings_flags(settings), *(["--backend", backends[0]] if len(backends) == 1 else [])]
        commands.append(shlex.join(args))
    return commands
