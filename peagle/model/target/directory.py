"""The target model directory (Hugging Face layout): the one module that opens it.

Extract, store check, train, export, eval and the packaged-target fetcher all open the target here:
its config (the text part of a multimodal config), its tokenizer, its weights (one safetensors file
or an index of shards, by name or by a name's suffix), the transformers model itself, its content
hash (which weights these are), the identity a store records, and the one check that a store was
extracted from this target. :class:`TargetDirectory` (:func:`open_target`) is an opened directory:
the config read, the tokenizer and the content hash when first asked for.

**Content hash.** A store's hidden states and top-k are only right for the exact target that
produced them. Names and shapes are not enough: a fine-tune, or the same architecture trained from
another seed, has the same config and weight files of the same sizes. Two hashes say which weights
these are: ``content_hash`` covers ``config.json``, each weight file's name and size, and a few evenly
spaced samples of its bytes (a few MiB read; every store records it), and ``weights_sha256`` every
byte of every weight file (:mod:`peagle.model.target.weights_hash`; each file hashed once per version of it,
the digest cached by path, size and mtime), so a change confined to tensors between the samples is
another target too. Stores recorded it since it exists; an older store is matched by its sampled
hash alone, as it always was.

**The compatibility check** (:func:`check_store_matches_target`) compares, in this order, the
architecture, hidden size, layer count and vocab size a store records with the target's, then the
content hash, and names the first that differs in one line.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from peagle.model.target.weights_hash import weights_sha256
from peagle.pipeline.weight_files import WEIGHTS_FILE, WEIGHTS_INDEX_FILE, has_weights, weight_map
from peagle.schemas import store as S
from peagle.schemas.errors import UserError, innermost_local, not_weights_only_line, one_line

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
WEIGHT_INDEX_SUFFIX = ".index.json"
PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth")
"""Weight files in torch's pickle format: read with weights-only unpickling, never anything more."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tekken.json", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")
"""Files that hold a tokenizer's vocabulary (one is needed; ``*.tiktoken`` files count too)."""
NUM_SAMPLES = 16
"""Content-hash samples per weight file, evenly spaced from its first to its last byte."""
SAMPLE_BYTES = 1 << 16


def check_target_dir(path: str | os.PathLike) -> Path:
    """``path`` as a Path, if it is a directory with a config.json.

    Raises:
        UserError: naming what is missing.
    """
    root = Path(path)
    if not root.is_dir():
        raise UserError(f"target model directory {root} does not exist")
    if not (root / CONFIG_FILE).is_file():
        raise UserError(f"target model directory {root} has no {CONFIG_FILE}")
    return root


def check_weights(path: str | os.PathLike) -> None:
    """Refuse a target directory without its weights, or with an index naming absent weight files.

    Checked when a target is opened, before anything is derived from it: the content hash of a
    directory without weights hashes its config alone, and a store started with that identity
    would refuse the same command once the weights are there (docs/reliability.md).

    Raises:
        UserError: naming the directory and what is missing.
    """
    root = Path(path)
    names = {p.name for p in root.iterdir() if p.is_file()}
    for index in sorted(n for n in names if n.endswith(WEIGHT_INDEX_SUFFIX)):
        try:
            files = set(json.loads((root / index).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise UserError(f"cannot read {root / index}: {one_line(err, with_type=False)}") from err
        missing = sorted(files - names)
        if missing:
            raise UserError(f"target {root} is missing {len(missing)} of the {len(files)} weight files its {index} "
                            f"names (first: {missing[0]}); copy them into {root}")
    if not any(n.endswith(WEIGHT_SUFFIXES) and not n.endswith(WEIGHT_INDEX_SUFFIX) for n in names):
        raise UserError(f"target {root} has no weights (no {WEIGHTS_FILE}, {WEIGHTS_INDEX_FILE} with its files, or "
                        f"pytorch_model.bin); copy the model's weight files into {root}")


def has_tokenizer_files(path: str | os.PathLike) -> bool:
    """Whether the directory holds a file a tokenizer's vocabulary can be read from."""
    root = Path(path)
    return any((root / name).is_file() for name in TOKENIZER_FILES) or any(root.glob("*.tiktoken"))


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The target's config.json as stored (``text_config`` not merged)."""
    root = check_target_dir(path)
    try:
        return json.loads((root / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {root / CONFIG_FILE}: {err}") from err


def text_config_dict(path: str | os.PathLike) -> dict[str, Any]:
    """config.json with a multimodal config's ``text_config`` merged over the top level (no
    transformers import: the vLLM backend reads the head's settings from this)."""
    config = read_config_json(path)
    return {**config, **(config.get("text_config") or {})}


def read_generation_config(path: str | os.PathLike) -> dict[str, Any]:
    """The target's generation_config.json ({} when it has none): e.g. the EOS ids decoding stops on."""
    gen = Path(path) / GENERATION_CONFIG_FILE
    try:
        return json.loads(gen.read_text()) if gen.is_file() else {}
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {gen}: {err}") from err


def load_config(path: str | os.PathLike) -> Any:
    """The target's transformers config, the text part of a multimodal one, with ``architectures``.

    Raises:
        UserError: the directory or its config.json is missing, or transformers cannot read it.
    """
    root = check_target_dir(path)
    from transformers import AutoConfig  # after the checks: a typo fails fast

    try:
        config = AutoConfig.from_pretrained(root)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"cannot load the config of target {root}: {one_line(err, with_type=False)}") from err
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "architectures", None):
        text.architectures = getattr(config, "architectures", None)
    return text


def load_tokenizer(path: str | os.PathLike, *, gguf_file: str | None = None) -> Any:
    """The target's tokenizer (from a GGUF file in ``path`` when ``gguf_file`` names one).

    Raises:
        UserError: transformers cannot load it (one line).
    """
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        return AutoTokenizer.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))
    except (OSError, ValueError, KeyError) as err:
        if not gguf_file and not has_tokenizer_files(path):  # say what is missing, not what transformers tried
            raise UserError(f"cannot load target {path}: it has no tokenizer files (none of "
                            f"{', '.join(TOKENIZER_FILES)}, *.tiktoken); copy the model's tokenizer files "
                            f"(and tokenizer_config.json) into {path}") from err
        raise UserError(f"cannot load target {path}: {one_line(err, with_type=False)}") from err


def load_causal_lm(path: str | os.PathLike, dtype: torch.dtype, device: torch.device | str, *,
                   gguf_file: str | None = None) -> Any:
    """The target as a transformers causal LM in ``dtype`` on ``device``, in eval mode (from a GGUF file
    in ``path``, dequantised, when ``gguf_file`` names one).

    Raises:
        UserError: transformers cannot load it (one line).
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **({"gguf_file": gguf_file} if gguf_file else {}))
    except pickle.UnpicklingError as err:  # a pytorch_model.bin that is a pickle of code: torch refused it
        raise UserError(not_weights_only_line(_pickle_file(err.__traceback__, Path(path)), err)) from None
    except (OSError, ValueError, KeyError, SafetensorError) as err:  # the last: a damaged weights file
        raise UserError(f"cannot load target model from {path}: {one_line(err, with_type=False)}") from err
    return model.to(device).eval()


def _pickle_file(tb: Any, root: Path) -> Path | None:
    """The weight file of ``root`` that transformers was unpickling when torch refused it: the innermost
    frame holding a path to a pickle-format weight file; else the directory's only such file."""
    named = innermost_local(tb, lambda v: isinstance(v, (str, os.PathLike))
                            and str(v).endswith(PICKLE_WEIGHT_SUFFIXES))
    if named is not None:
        return Path(named)
    found = sorted(p for p in root.iterdir() if p.name.endswith(PICKLE_WEIGHT_SUFFIXES))
    return found[0] if len(found) == 1 else root


def architecture(config: Any) -> str:
    """The first of ``architectures`` (the model type when a config lists none)."""
    return (getattr(config, "architectures", None) or [config.model_type])[0]


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The files both hashes cover: weights and weight indexes, sorted by name."""
    return [p for p in sorted(Path(path).iterdir()) if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]


def content_hash(path: str | os.PathLike) -> str:
    """sha256 over config.json and, per weight file (sorted by name), its name, size and byte samples."""
    root = Path(path)
    h = hashlib.sha256((root / CONFIG_FILE).read_bytes())
    for p in weight_files(root):
        size = p.stat().st_size
        h.update(f"\n{p.name}\t{size}\n".encode())
        with open(p, "rb") as f:
            for i in range(NUM_SAMPLES):
                h.update(os.pread(f.fileno(), SAMPLE_BYTES, _sample_offset(i, size)))
    return h.hexdigest()


def _sample_offset(i: int, size: int) -> int:
    """Start of sample ``i``: the first begins at byte 0, the last ends at the file's end."""
    return (max(size - SAMPLE_BYTES, 0) * i) // (NUM_SAMPLES - 1)


class TargetWeights:
    """The target's safetensors weights by tensor name (sharded through the index, or one file)."""

    def __init__(self, path: str | os.PathLike):
        self.root = Path(path)
        if not has_weights(self.root):
            raise UserError(f"target {self.root} has no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}")
        self.file_of_key: dict[str, str] = weight_map(self.root)  # the index's names stay inside the target

    @property
    def keys(self) -> set[str]:
        return set(self.file_of_key)

    def read(self, name: str) -> Tensor:
        from safetensors import safe_open

        with safe_open(self.root / self.file_of_key[name], framework="pt") as f:
            return f.get_tensor(name)

    def find(self, suffix: str) -> str | None:
        """The one key ending in ``suffix`` at a module boundary (``model.``, ``language_model.`` ...),
        or None when there is none or more than one."""
        hits = sorted(k for k in self.file_of_key if k == suffix or k.endswith("." + suffix))
        return hits[0] if len(hits) == 1 else None

    def read_first(self, names: tuple[str, ...]) -> Tensor:
        """The first of ``names`` the target has (checkpoint layouts differ between families)."""
        for name in names:
            if name in self.file_of_key:
                return self.read(name)
        raise UserError(f"target {self.root} has none of the weights {list(names)}")


@dataclass
class TargetDirectory:
    """An opened target directory: its (text) config; the tokenizer is loaded and the content hash
    computed once each, on first use (training needs neither)."""

    path: Path
    config: Any

    @functools.cached_property
    def content_hash(self) -> str:
        return content_hash(self.path)

    @functools.cached_property
    def weights_sha256(self) -> str:
        """Every byte of every weight file (module docstring); read once per version of a file."""
        return weights_sha256(self.path, CONFIG_FILE, weight_files(self.path))

    def other_weights(self, identity: S.TargetIdentity) -> bool:
        """Whether ``identity`` (what a store records) names other weights than these: its sampled hash,
        then, where it records one, the full one."""
        return (identity.content_hash != self.content_hash
                or bool(identity.weights_sha256) and identity.weights_sha256 != self.weights_sha256)

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The target's tokenizer (:func:`load_tokenizer`)."""
        return load_tokenizer(self.path)

    def identity(self, dtype: str) -> S.TargetIdentity:
        """What a store extracted from this target with compute ``dtype`` records about it."""
        c = self.config
        return S.TargetIdentity(path=str(self.path.resolve()), architecture=architecture(c),
                                num_hidden_layers=int(c.num_hidden_layers), hidden_size=int(c.hidden_size),
                                vocab_size=int(c.vocab_size), dtype=dtype, content_hash=self.content_hash,
                                weights_sha256=self.weights_sha256)


def open_target(path: str | os.PathLike) -> TargetDirectory:
    """The target directory with its config loaded (weights are read on demand: :class:`TargetWeights`,
    but must be there: :func:`check_weights`).

    Raises:
        UserError: the directory, its config.json or its weights are missing, or transformers cannot
            read the config.
    """
    config = load_config(path)
    check_weights(path)
    return TargetDirectory(path=Path(path), config=config)


def check_store_matches_target(settings: S.StoreSettings, target: TargetDirectory, *,
                               store: str | os.PathLike) -> None:
    """The one store-vs-target check (module docstring).

    Raises:
        UserError: one line naming the first of architecture, hidden size, layers, vocab that
            differs, or, for a target of the same shape, that its weights are other ones.
    """
    t, c = settings.target, target.config
    for name, held, want in (("architecture", t.architecture, architecture(c)),
                             ("hidden_size", t.hidden_size, c.hidden_size),
                             ("num_hidden_layers", t.num_hidden_layers, c.num_hidden_layers),
                             ("vocab_size", t.vocab_size, c.vocab_size)):
        if str(held) != str(want):
            raise UserError(f"store {store} was extracted from a target with {name} {held}, --target has "
                            f"{name} {want}")
    if target.content_hash != t.content_hash:
        raise UserError(f"store {store} was extracted from target {t.path} (content hash {t.content_hash[:12]}), "
                        f"--target {target.path} has other weights (content hash {target.content_hash[:12]}); "
                        "use the target the store was extracted from")
    if target.other_weights(t):
        raise UserError(f"store {store} was extracted from target {t.path} (weights sha256 {t.weights_sha256[:12]}), "
                        f"--target {target.path} has other weights (weights sha256 {target.weights_sha256[:12]}: a "
                        "tensor differs); use the target the store was extracted from")
