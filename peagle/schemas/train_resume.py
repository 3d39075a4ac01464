"""Whether a checkpointed `peagle train` run may resume under the current flags (docs/reliability.md).

A resumed run must compute what the killed one computed: every plain field of :class:`TrainConfig` and
its parts (flat names, the flags') but :data:`SAFE_TO_CHANGE` must be what the checkpointed run was started with (``run.json`` and the
checkpoint's config). :func:`config_mismatch` names the first that differs, in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peagle.schemas.components import leaves
from peagle.schemas.errors import show_value
from peagle.schemas.tracking_config import TRACKING_FIELDS
from peagle.schemas.train_config import TrainConfig, parse_store_spec

SAFE_TO_CHANGE = frozenset({
    "out", "max_steps", "epochs", "eval_every", "save_every", "keep_checkpoints", "log_every", "num_workers",
    "verify", "eval_store", "allow_bad_aux_rows", "compile", "flex_kernel", "allow_incomplete", "follow_timeout",
    "max_bad_steps", *TRACKING_FIELDS,
})
"""Fields a resumed run may change: they steer how long the run goes, what it reports and where it
lives (a run directory may be moved) and where it is watched (the tracker flags), not what a step computes (``max_bad_steps``: how many
skipped non-finite steps stop the run, so a stopped run can be resumed with a larger budget). (Changing the run length re-times
the cosine decay from the resume step on.)"""

ABSENT_MEANT: dict[str, Any] = {"optimizer": "adamw", "norm_before_residual": False, "norm_before_fc": False,
                                 "fc_norm": False, "train_embeddings": True}
"""What a field missing from a saved config meant, where that is not today's default: runs
checkpointed before ``--optimizer`` existed trained with AdamW, and runs checkpointed before the
EAGLE-3.1 norm options existed trained without them (both since made defaults); runs from before
``--train-embeddings`` trained the embedding."""


def config_mismatch(saved: dict[str, Any], current: TrainConfig) -> str | None:
    """The first field (other than ``SAFE_TO_CHANGE``) that differs, as one line; None if none does.

    Paths compare after resolving, so ``./store`` and ``/abs/store`` are the same store. ``saved`` is
    the flat mapping of :meth:`TrainConfig.to_dict` (every plain field of every part under its flag's
    name, as runs from before the parts were written too), compared leaf by leaf.
    """
    now = current.to_dict()
    for leaf in leaves(TrainConfig):
        name = leaf.name
        if name in SAFE_TO_CHANGE:
            continue
        old = saved.get(name, ABSENT_MEANT.get(name, leaf.field.default))
        new = now[name]
        if _normalise(name, old) != _normalise(name, new):
            return (f"--{name.replace('_', '-')} was {show_value(old)} in the checkpointed run and is {show_value(new)} "
                    f"now; resume with the same value or use a new --out")
    return None


_PATH_FIELDS = ("target", "out", "init_from", "epoch_shards")


def _normalise(name: str, value: Any) -> Any:
    if value is None:
        return None
    if name == "store":
        specs = [parse_store_spec(s) for s in value]
        return [(str(Path(s.path).resolve()), s.weight) for s in specs]
    if name in _PATH_FIELDS:
        return str(Path(value).resolve())
    if isinstance(value, (list, tuple)):
        return list(value)
    return value


