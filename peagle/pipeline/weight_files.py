"""A model directory's weights: one ``model.safetensors``, or shards named by an index.

Hugging Face's sharded layout is ``model-00001-of-00003.safetensors`` ... plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": BYTES}, "weight_map": {KEY: FILE}}``);
transformers and vLLM load either (vLLM globs ``*.safetensors`` and keeps the files the index
names). peagle reads both in targets and exports, and writes shards where a file must stay small:
a draft committed to git, results a device call returns in 16 MiB files (``peagle export
--max-file-mib``).

The index comes from elsewhere like any file of a target or an export, so the names in its
``weight_map`` go through :func:`peagle.pipeline.contained.contained`: a shard named ``../x`` or a
link out of the directory is refused in one line before anything is read.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from peagle.pipeline.contained import contained
from peagle.schemas.errors import UserError, one_line

if TYPE_CHECKING:
    from torch import Tensor

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
"""What :func:`shard_name` writes."""


def shard_name(i: int, n: int) -> str:
    """The ``i``-th (0-based) of ``n`` shard files, named as transformers names them."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def is_weights_file_name(name: str) -> bool:
    """Whether ``name`` is one of the files that hold a directory's weights (one file, an index, a shard)."""
    return name in (WEIGHTS_FILE, WEIGHTS_INDEX_FILE) or SHARD_NAME.fullmatch(name) is not None


def weights_entry(root: str | os.PathLike) -> str:
    """The file that stands for ``root``'s weights in a message: the index of shards, else the one file."""
    return WEIGHTS_INDEX_FILE if (Path(root) / WEIGHTS_INDEX_FILE).is_file() else WEIGHTS_FILE


def has_weights(root: str | os.PathLike) -> bool:
    """Whether ``root`` holds one weights file or an index (its shards unchecked)."""
    root = Path(root)
    return (root / WEIGHTS_FILE).is_file() or (root / WEIGHTS_INDEX_FILE).is_file()


def weight_map(root: str | os.PathLike) -> dict[str, str]:
    """Every tensor name of ``root``'s weights and the file (a name inside ``root``) that holds it.

    Raises:
        UserError: one line: no weights, an unreadable index, or an index naming a file outside
            ``root`` or one that is missing.
    """
    from safetensors import safe_open

    root = Path(root)
    index = root / WEIGHTS_INDEX_FILE
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
            if not isinstance(mapping, dict) or not all(isinstance(k, str) for k in mapping):
                raise TypeError("weight_map is not an object of tensor names")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"cannot read {index}: {one_line(err, with_type=False)}") from err
        for name in sorted(set(mapping.values()), key=str):
            path = contained(root, name, named_by=index, field="weight_map")
            if not path.is_file():
                raise UserError(f"{index} names {name}, which is not in {root}; copy the weight files the "
                                f"index names into {root}")
        return dict(mapping)
    single = root / WEIGHTS_FILE
    if not single.is_file():
        raise UserError(f"{root} has no weights ({WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE})")
    try:
        with safe_open(str(single), framework="pt") as f:
            return {key: WEIGHTS_FILE for key in f.keys()}
    except Exception as err:  # safetensors raises its own error types for a damaged file
        raise UserError(f"{single} is unreadable ({one_line(err, with_type=False)})") from err


def weight_file_names(root: str | os.PathLike) -> list[str]:
    """The files holding ``root``'s weights (one, or the index's shards), sorted."""
    return sorted(set(weight_map(root).values()))


def iter_tensors(root: str | os.PathLike) -> Iterator[tuple[str, "Tensor"]]:
    """``(name, tensor)`` of every weight, one at a time (a file open while its tensors are read)."""
    from safetensors import safe_open

    root = Path(root)
    by_file: dict[str, list[str]] = {}
    for key, name in weight_map(root).items():
        by_file.setdefault(name, []).append(key)
    for name in sorted(by_file):
        with safe_open(str(root / name), framework="pt") as f:
            present = set(f.keys())
            for key in by_file[name]:
                if key not in present:
                    raise UserError(f"{root / WEIGHTS_INDEX_FILE} puts {key} in {name}, which does not hold it")
                yield key, f.get_tensor(key)


def load_tensors(root: str | os.PathLike) -> dict[str, "Tensor"]:
    """Every weight of ``root`` by name; a shard the index does not describe exactly is refused.

    Raises:
        UserError: one line naming the file: unreadable, a tensor missing from its shard, or a
            shard holding tensors its index does not list.
    """
    from safetensors.torch import load_file

    root = Path(root)
    mapping = weight_map(root)
    tensors: dict[str, Tensor] = {}
    for name in sorted(set(mapping.values())):
        try:
            part = load_file(str(root / name))
        except Exception as err:  # safetensors raises its own error types for a damaged file
            raise UserError(f"{root / name} is unreadable ({one_line(err, with_type=False)})") from err
        wanted = {key for key, file in mapping.items() if file == name}
        if set(part) != wanted:
            extra, missing = sorted(set(part) - wanted), sorted(wanted - set(part))
            raise UserError(f"{root / name} does not hold what {WEIGHTS_INDEX_FILE} says (missing: "
                            f"{missing[:3]}, not listed: {extra[:3]})")
        tensors.update(part)
    return tensors


def save_tensors(tensors: dict[str, "Tensor"], root: str | os.PathLike, *, max_file_bytes: int | None = None,
                 metadata: dict[str, str] | None = None) -> list[str]:
    """Write ``tensors`` into ``root`` (a fresh directory the caller renames into place): one
    ``model.safetensors`` when they fit in ``max_file_bytes`` (or it is None), else shards of at most
    that size each (a tensor larger than it gets a shard of its own), in the order given, and the index.
    Returns the names of the files written."""
    from safetensors.torch import save_file

    root = Path(root)
    sizes = {key: t.numel() * t.element_size() for key, t in tensors.items()}
    if max_file_bytes is None or sum(sizes.values()) <= max_file_bytes:
        save_file(tensors, str(root / WEIGHTS_FILE), metadata=metadata)
        return [WEIGHTS_FILE]
    groups: list[list[str]] = [[]]
    used = 0
    for key, size in sizes.items():
        if groups[-1] and used + size > max_file_bytes:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += size
    names = [shard_name(i, len(groups)) for i in range(len(groups))]
    for name, keys in zip(names, groups):
        save_file({key: tensors[key] for key in keys}, str(root / name), metadata=metadata)
    index = {"metadata": {"total_size": sum(sizes.values())},
             "weight_map": {key: name for name, keys in zip(names, groups) for key in keys}}
    (root / WEIGHTS_INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*names, WEIGHTS_INDEX_FILE]
