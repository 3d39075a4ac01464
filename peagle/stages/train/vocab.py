"""The draft vocabulary (docs/draft-and-export.md): the N most frequent supervised target tokens of a store.

The draft's ``lm_head`` covers only ``draft_vocab_size`` target tokens. They are chosen by counting
the tokens the draft is charged for predicting, over the whole store, in one pass over the Parquet
columns (``input_ids``, ``loss_mask``; no tensor is read), in training coordinates from the store
reader (docs/indexing.md):

* a token counts iff it is the target of a supervised position: ``targets[p] = x_{p+2}`` with
  ``m[p] = 1``, i.e. the ``x_i`` with ``loss_mask[i] = 1`` and ``i >= 2`` (``x_0``, ``x_1`` are never
  predicted);
* the ``N`` ids with the highest counts are kept, ties broken by the lower id, and sorted by id
  ascending; the mask token (``StoreSettings.mask_token_id``) is never selected;
* ``d2t[i] = target_id_i - i`` (int64 offsets) and ``t2d`` (bool over the target vocab) are the
  buffers vLLM reads; ``coverage`` is the share of counted tokens whose id is in the draft vocab.

With a held-out store (``peagle vocab --heldout-store``, the same tokenizer), the vocab also records
how much of *unseen* text it covers, and what other sizes would (ids ranked by this store's counts):
the share of held-out tokens the draft can propose at all, an upper bound on acceptance at every
depth. A store's own coverage flatters a small vocab; held-out text shows the tail it misses.

``N == target vocab`` is the identity: no mapping at all (export omits ``d2t``/``t2d``, vLLM refuses a
``d2t`` then), recorded as ``identity: true``. The mask token is part of that vocab, like every id.

Files (written atomically; the json is written last and is what marks a vocab as built)::

    STORE/vocab/draft-N.safetensors   selected_ids [N] int64, counts [V] int64, d2t [N] int64, t2d [V] bool
    STORE/vocab/draft-N.json          sizes, identity, coverage, counts, mask token, store manifest hash,
                                      the shards counted (``shards``)

An incomplete store (planned shards without a commit record, ``peagle.pipeline.plan``) is refused
unless ``allow_incomplete``; a store without a single supervised token is refused always (there is
nothing to choose from, and nothing to train on).

Shape letters: V = target vocab size, N = draft vocab size.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from peagle.pipeline.atomic import canonical_json, raise_if_disk_full, writable_problem
from peagle.pipeline.checkpoint_files import read_checkpoint_part
from peagle.pipeline.plan import format_ranges, store_completeness
from peagle.pipeline.progress import track
from peagle.pipeline.store import Store, manifest_hash, open_store, write_bytes_atomic
from peagle.pipeline.store_reader import iter_shard_columns
from peagle.schemas import store as S
from peagle.schemas.checkpoint import DRAFT_CONFIG_KEY
from peagle.schemas.errors import UserError
from peagle.stages.train import checkpoint as ckpt

log = logging.getLogger(__name__)

VOCAB_VERSION = 1


def vocab_stem(draft_vocab_size: int) -> str:
    return f"{S.VOCAB_DIR}/draft-{draft_vocab_size}"


@dataclass(frozen=True, kw_only=True)
class DraftVocab:
    """A built draft vocabulary: which target ids the draft's ``lm_head`` covers.

    ``d2t``/``t2d`` are None for the identity vocab (draft vocab == target vocab).
    """

    draft_vocab_size: int
    target_vocab_size: int
    identity: bool
    selected_ids_N: torch.Tensor  # int64, ascending target ids
    counts_V: torch.Tensor  # int64, supervised-token count per target id
    d2t_N: torch.Tensor | None  # int64, target_id - draft_id
    t2d_V: torch.Tensor | None  # bool, target id is in the draft vocab
    coverage: float
    num_supervised_tokens: int
    mask_token_id: int | None
    manifest_hash: str
    shards: str | None = None  # the shards counted ("0-7"); None in vocabs built before it was recorded
    heldout: dict[str, Any] | None = None  # heldout_coverage()'s record, when a held-out store was given

    def identity_record(self) -> dict[str, Any]:
        """What a run records of its vocab (run.json, checkpoints): a resumed run must find the same one."""
        return {"draft_vocab_size": self.draft_vocab_size, "manifest_hash": self.manifest_hash, "shards": self.shards}

    def target_to_draft(self) -> torch.Tensor:
        """``[V]`` int64: the draft id of every target id, -1 where it is not in the draft vocab."""
        if self.identity:
            return torch.arange(self.target_vocab_size, dtype=torch.long)
        out_V = torch.full((self.target_vocab_size,), -1, dtype=torch.long)
        out_V[self.selected_ids_N] = torch.arange(self.draft_vocab_size, dtype=torch.long)
        return out_V


def count_supervised_tokens(store: Store, *, progress: bool = False) -> np.ndarray:
    """``[V]`` int64 counts of the charged tokens (the targets of supervised positions) over all shards.

    Raises:
        UserError: when a shard holds a token id outside the target vocab or ragged columns.
    """
    vocab_size = store.settings.target.vocab_size
    counts_V = np.zeros(vocab_size, dtype=np.int64)
    for index, columns in track(iter_shard_columns(store), total=len(store.shards), desc="counting tokens",
                                unit="shard", enabled=progress):
        picked = columns.targets[columns.supervised]
        if picked.size and (picked.min() < 0 or picked.max() >= vocab_size):
            raise UserError(f"store {store.root}: shard {index} holds token id "
                            f"{int(picked.max())} outside the target vocab of {vocab_size}")
        counts_V += np.bincount(picked, minlength=vocab_size)
    return counts_V


def select_draft_ids(counts_V: np.ndarray, draft_vocab_size: int, mask_token_id: int | None) -> np.ndarray:
    """The ``draft_vocab_size`` most frequent ids (ties: lower id), sorted ascending, mask token excluded."""
    vocab_size = counts_V.size
    ids = np.arange(vocab_size, dtype=np.int64)
    if mask_token_id is not None and 0 <= mask_token_id < vocab_size:
        ids = ids[ids != mask_token_id]
    if draft_vocab_size > ids.size:
        raise UserError(f"--draft-vocab-size {draft_vocab_size} leaves no room to exclude the mask token "
                        f"{mask_token_id}: at most {ids.size} (or exactly {vocab_size}, the identity vocab)")
    order = np.lexsort((ids, -counts_V[ids]))  # primary: count descending; then id ascending
    return np.sort(ids[order[:draft_vocab_size]])


def vocab_ids(counts_V: np.ndarray, draft_vocab_size: int, mask_token_id: int | None) -> np.ndarray:
    """The target ids a draft vocab of this size holds: every id for the identity vocab (N == V),
    else :func:`select_draft_ids`."""
    if draft_vocab_size == counts_V.size:
        return np.arange(counts_V.size, dtype=np.int64)
    return select_draft_ids(counts_V, draft_vocab_size, mask_token_id)


def coverage_sizes(draft_vocab_size: int, target_vocab_size: int) -> list[int]:
    """The sizes a coverage table compares: N/4 .. 8N by doublings, within (0, V)."""
    sizes = {draft_vocab_size * 2 ** e // 4 for e in range(6)} | {draft_vocab_size}
    return sorted(n for n in sizes if 0 < n < target_vocab_size or n == draft_vocab_size)


def open_heldout_store(store: Store, heldout_root: str | Path) -> Store:
    """The held-out store whose coverage a vocab of ``store`` is measured on, checked before any counting.

    Raises:
        UserError: it is unreadable, or was tokenized by another tokenizer (its ids would mean other tokens).
    """
    try:
        heldout = open_store(heldout_root)
    except UserError as err:
        raise UserError(f"--heldout-store: {err}") from err
    ours, theirs = store.settings, heldout.settings
    if (theirs.tokenizer_fingerprint, theirs.target.vocab_size) != (ours.tokenizer_fingerprint, ours.target.vocab_size):
        raise UserError(f"--heldout-store {heldout.root} was tokenized by another tokenizer than store {store.root} "
                        f"(vocab {theirs.target.vocab_size} against {ours.target.vocab_size}, or another "
                        "fingerprint): its token ids cannot be compared")
    return heldout


def heldout_coverage(store: Store, counts_V: np.ndarray, draft_vocab_size: int, heldout: Store, *,
                     progress: bool = False) -> dict[str, Any]:
    """How much of another store's supervised tokens a vocab chosen from ``counts_V`` covers, at
    ``draft_vocab_size`` and at the neighbouring sizes of :func:`coverage_sizes`.

    Raises:
        UserError: the held-out store holds no supervised token.
    """
    ours = store.settings
    heldout_V = count_supervised_tokens(heldout, progress=progress)
    total = int(heldout_V.sum())
    if total == 0:
        raise UserError(f"--heldout-store {heldout.root} holds no supervised token: nothing to measure coverage on")
    by_size = []  # [size, coverage] pairs, ascending (a list: canonical json sorts the keys of a dict)
    for n in coverage_sizes(draft_vocab_size, ours.target.vocab_size):
        by_size.append([n, int(heldout_V[vocab_ids(counts_V, n, ours.mask_token_id)].sum()) / total])
    return {"store": str(heldout.root), "manifest_hash": manifest_hash(heldout.root), "num_supervised_tokens": total,
            "coverage": dict(by_size)[draft_vocab_size], "coverage_by_size": by_size}


def build_draft_vocab(store_root: str | Path, draft_vocab_size: int, *, progress: bool = False,
                      allow_incomplete: bool = False, heldout_store: str | Path | None = None,
                      echo: Callable[[str], None] = print) -> DraftVocab:
    """Count, select, and write ``STORE/vocab/draft-N.{safetensors,json}``; returns the vocab.
    With ``heldout_store``, its coverage of that store's supervised tokens is measured and recorded
    too (:func:`heldout_coverage`).

    Raises:
        UserError: when ``draft_vocab_size`` is not in ``[1, target vocab]``, the store is unreadable,
            incomplete (without ``allow_incomplete``) or holds no supervised token, or the held-out
            store cannot be compared with it.
    """
    store = open_store(store_root)
    completeness = store_completeness(store.root, (r.index for r in store.shards))
    if not completeness.complete:
        if not allow_incomplete:
            raise UserError(completeness.refusal("count"))
        echo(completeness.warning("counting"))
    vocab_size = store.settings.target.vocab_size
    mask_token_id = store.settings.mask_token_id
    if draft_vocab_size < 1:
        raise UserError(f"--draft-vocab-size must be at least 1, got {draft_vocab_size}")
    if draft_vocab_size > vocab_size:
        raise UserError(f"--draft-vocab-size {draft_vocab_size} is larger than the target vocab "
                        f"{vocab_size} (store {store.root})")
    heldout_opened = None if heldout_store is None else open_heldout_store(store, heldout_store)  # refuse early
    problem = writable_problem(store.root / S.VOCAB_DIR)  # before counting, not after (a shared, read-only store)
    if problem is not None:
        raise_if_disk_full(problem, store.root / S.VOCAB_DIR)
        raise UserError(f"cannot write the draft vocabulary into {store.root / S.VOCAB_DIR} ({problem.strerror}): "
                        "`peagle vocab` writes it into the store; make the store writable for this user, or copy "
                        "it somewhere writable and build the vocabulary there")
    counts_V = count_supervised_tokens(store, progress=progress)
    if not counts_V.any():
        raise UserError(f"store {store.root} holds no supervised token in its {len(store.shards)} committed shards "
                        f"({store.num_samples} samples): nothing to build a vocab from or to train on; "
                        f"`peagle store info --store {store.root}` shows what extraction skipped")
    identity = draft_vocab_size == vocab_size
    selected_N = vocab_ids(counts_V, draft_vocab_size, mask_token_id)
    total = int(counts_V.sum())
    in_vocab = int(counts_V[selected_N].sum())
    coverage = in_vocab / total if total else 0.0
    heldout = (None if heldout_opened is None else
               heldout_coverage(store, counts_V, draft_vocab_size, heldout_opened, progress=progress))

    tensors = {"selected_ids": torch.from_numpy(selected_N), "counts": torch.from_numpy(counts_V)}
    d2t_N = t2d_V = None
    if not identity:
        d2t_N = torch.from_numpy(selected_N - np.arange(draft_vocab_size, dtype=np.int64))
        t2d_V = torch.zeros(vocab_size, dtype=torch.bool)
        t2d_V[torch.from_numpy(selected_N)] = True
        tensors.update(d2t=d2t_N, t2d=t2d_V)
    digest = manifest_hash(store.root)
    info = {
        "version": VOCAB_VERSION,
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": vocab_size,
        "identity": identity,
        "coverage": coverage,
        "num_supervised_tokens": total,
        "num_in_vocab_tokens": in_vocab,
        "num_distinct_supervised_ids": int((counts_V > 0).sum()),
        "mask_token_id": mask_token_id,
        "manifest_hash": digest,
        "num_shards": len(store.shards),
        "shards": format_ranges(r.index for r in store.shards),
        "complete": completeness.complete,
        "num_samples": store.num_samples,
        "tensors": f"draft-{draft_vocab_size}.safetensors",
        **({"heldout": heldout} if heldout else {}),
    }
    from safetensors.torch import save

    stem = vocab_stem(draft_vocab_size)
    write_bytes_atomic(store.root, stem + ".safetensors", save({k: v.contiguous() for k, v in tensors.items()}))
    write_bytes_atomic(store.root, stem + ".json", canonical_json(info))
    return DraftVocab(
        draft_vocab_size=draft_vocab_size, target_vocab_size=vocab_size, identity=identity,
        selected_ids_N=tensors["selected_ids"], counts_V=tensors["counts"], d2t_N=d2t_N, t2d_V=t2d_V,
        coverage=coverage, num_supervised_tokens=total, mask_token_id=mask_token_id, manifest_hash=digest,
        heldout=heldout,
    )


def built_draft_vocab_sizes(store_root: str | Path) -> list[int]:
    """Sizes of the draft vocabularies `peagle vocab` has built in a store (its json marks one built)."""
    found = []
    for path in (Path(store_root) / S.VOCAB_DIR).glob("draft-*.json"):
        size = path.stem.removeprefix("draft-")
        if size.isdigit() and path.with_suffix(".safetensors").exists():
            found.append(int(size))
    return sorted(found)


def choose_draft_vocab_size(store_root: str | Path, asked: int | None, target_vocab_size: int,
                            default: int) -> tuple[int, str | None]:
    """(draft vocab size to train, a line saying how it was chosen when it was not asked for).

    Without ``--draft-vocab-size``: the one vocabulary built in the store; with none built, the whole
    target vocab when that is at most ``default`` (no mapping), else ``default`` (whose absence
    ``load_draft_vocab`` then reports with the command that builds it).

    Raises:
        UserError: several vocabularies are built and none was asked for.
    """
    if asked is not None:
        return asked, None
    built = built_draft_vocab_sizes(store_root)
    if len(built) == 1:
        return built[0], (f"draft vocab: the one `peagle vocab` built in {store_root} ({built[0]:,} tokens; "
                          "--draft-vocab-size picks another)")
    if len(built) > 1:
        raise UserError(f"store {store_root} has draft vocabs of sizes {', '.join(map(str, built))}; pass "
                        "--draft-vocab-size to pick one")
    if target_vocab_size <= default:
        return target_vocab_size, (f"draft vocab: none built in {store_root}, so the whole target vocab "
                                   f"({target_vocab_size:,} tokens, no mapping)")
    return default, None


def load_draft_vocab(store_root: str | Path, draft_vocab_size: int, *, growing: bool = False,
                     say: Callable[[str], None] = print) -> DraftVocab:
    """Read a vocab written by ``peagle vocab``; warns when the store has changed since, or (``growing``:
    a store followed while extraction goes on) says which shards the vocab, frozen for the run, counted.

    Raises:
        UserError: when that vocab was never built (naming the command that builds it) or is unreadable.
    """
    root = Path(store_root)
    stem = vocab_stem(draft_vocab_size)
    info_path, tensors_path = root / (stem + ".json"), root / (stem + ".safetensors")
    if not info_path.exists() or not tensors_path.exists():
        raise UserError(f"store {root} has no draft vocab of size {draft_vocab_size}; build it with "
                        f"`peagle vocab --store {root} --draft-vocab-size {draft_vocab_size}`")
    try:
        info = json.loads(info_path.read_text())
        from safetensors.torch import load_file

        tensors = load_file(tensors_path)
    except Exception as err:  # unreadable json or safetensors: same advice
        raise UserError(f"draft vocab {info_path} is unreadable ({str(err).splitlines()[0]}); rebuild it with "
                        f"`peagle vocab --store {root} --draft-vocab-size {draft_vocab_size}`") from err
    current = manifest_hash(root)
    if growing:
        say(f"draft vocab: frozen for this run as `peagle vocab` built it from shards {info.get('shards', '?')} of "
            f"{root} ({info['num_shards']} shards); shards committed since are trained on, not counted")
    elif info["manifest_hash"] != current:
        log.warning("draft vocab %s was built from an older state of store %s (shards added since); "
                    "rebuild it with `peagle vocab` to count them", info_path, root)
    return DraftVocab(
        draft_vocab_size=info["draft_vocab_size"], target_vocab_size=info["target_vocab_size"],
        identity=info["identity"], selected_ids_N=tensors["selected_ids"], counts_V=tensors["counts"],
        d2t_N=tensors.get("d2t"), t2d_V=tensors.get("t2d"), coverage=info["coverage"],
        num_supervised_tokens=info["num_supervised_tokens"], mask_token_id=info["mask_token_id"],
        manifest_hash=info["manifest_hash"], shards=info.get("shards"), heldout=info.get("heldout"),
    )


def checkpoint_draft_vocab(checkpoint: Path | None) -> tuple[int | None, dict[str, Any] | None]:
    """(draft vocab size, vocab record) a run being resumed was built with (None, None without a checkpoint;
    the record is None for an identity vocab and in checkpoints written before it was kept)."""
    if checkpoint is None:
        return None, None
    part = read_checkpoint_part(checkpoint, ckpt.CONFIG)
    return int(part[DRAFT_CONFIG_KEY]["draft_vocab_size"]), part.get("draft_vocab")


def check_same_vocab(saved: dict[str, Any] | None, now: dict[str, Any] | None, store_root: str | Path) -> None:
    """A resumed run trains the vocab it began with: its lm_head rows are those target ids.

    Raises:
        UserError: the vocab file was rebuilt from another state of the store since the run began.
    """
    if saved is None or now is None or saved["manifest_hash"] == now["manifest_hash"]:
        return
    raise UserError(f"draft vocab {Path(store_root) / vocab_stem(now['draft_vocab_size'])} was rebuilt since this "
                    f"run began (it counted shards {saved.get('shards') or '?'} then, {now.get('shards') or '?'} "
                    "now): a resumed run must keep its vocab; train the new one with a new --out")
