"""The shard store's on-disk contract (DESIGN §2): file names, columns, tensor names, records.

A store is a directory::

    store.json              StoreSettings: written once when the store is created, never changed
    commits/00000.json      ShardRecord: one per committed shard (the source of truth for "done")
    shards/00000.parquet    one row per sample (PARQUET_COLUMNS)
    shards/00000.safetensors  TENSOR_NAMES, rows = all tokens of the shard's samples, in order
    manifest.json           derived: settings + every commit record, canonical (sorted, no timestamps)
    vocab/                  draft vocabularies (peagle vocab)

Everything here is plain data (dataclasses <-> JSON dicts); the I/O lives in pipeline/store.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1

STORE_SETTINGS_FILE = "store.json"
MANIFEST_FILE = "manifest.json"
COMMITS_DIR = "commits"
SHARDS_DIR = "shards"
VOCAB_DIR = "vocab"
INPUTS_DIR = "inputs"

AUX_HIDDEN = "aux_hidden"  # [T, A, H] bfloat16
TOPK_IDS = "topk_ids"  # [T, k] int32
TOPK_LOGPROBS = "topk_logprobs"  # [T, k] float16 or float32
TENSOR_NAMES = (AUX_HIDDEN, TOPK_IDS, TOPK_LOGPROBS)

PARQUET_COLUMNS = ("sample_id", "source", "input_ids", "loss_mask", "num_tokens", "token_offset")

# Token counts in commit records (``ShardRecord.token_counts``): "supervised.<kind>" and
# "unsupervised.<role>" (a message role, "template" or "unattributed").
SUPERVISED = "supervised"
UNSUPERVISED = "unsupervised"
OUTSIDE_ASSISTANT = "outside_assistant"  # a supervised token in another role's message: a wrong mask
SUPERVISED_KINDS = ("content", "reasoning", "tool_call", "end_of_turn", OUTSIDE_ASSISTANT)

# How the mask token was chosen (``StoreSettings.mask_token_source``).
MASK_FROM_TOKENIZER = "tokenizer_mask_token"  # the tokenizer's own mask token
MASK_FROM_UNUSED_ROW = "unused_embedding_row"  # an embedding row beyond every id the tokenizer produces
MASK_FROM_RESERVED = "reserved_special_token"  # a reserved special token the template never writes
MASK_FROM_FLAG = "explicit"  # --mask-token-id
MASK_TOKEN_SOURCES = (MASK_FROM_TOKENIZER, MASK_FROM_UNUSED_ROW, MASK_FROM_RESERVED, MASK_FROM_FLAG)


def shard_stem(index: int) -> str:
    return f"{index:05d}"


def parquet_name(index: int) -> str:
    return f"{SHARDS_DIR}/{shard_stem(index)}.parquet"


def tensors_name(index: int) -> str:
    return f"{SHARDS_DIR}/{shard_stem(index)}.safetensors"


def commit_name(index: int) -> str:
    return f"{COMMITS_DIR}/{shard_stem(index)}.json"


@dataclass(frozen=True, kw_only=True)
class TargetIdentity:
    """Which target produced a store. Two stores are compatible only if these agree."""

    path: str
    architecture: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    content_hash: str  # sha256 over the target's config + weight file names and sizes


_ADDED_LATER = {"mask_token": None, "mask_token_source": None, "supervise_reasoning": True}
_RECORD_ADDED_LATER = {"token_counts": {}, "num_supervised_turns": 0, "num_rendered_per_turn": 0}


@dataclass(frozen=True, kw_only=True)
class StoreSettings:
    """Everything that must be equal for two extraction runs to write into one store."""

    schema_version: int = SCHEMA_VERSION
    target: TargetIdentity
    tokenizer_fingerprint: str
    chat_template_hash: str
    aux_layer_ids: tuple[int, ...]
    topk: int
    max_seq_len: int
    logprob_dtype: str  # "float16" | "float32"
    loss_on: str  # which assistant turns are supervised: "all" | "last" | "per_turn"
    # The draft's mask token (its input at depths >= 1): chosen once by extract, never present in any
    # stored input_ids. None only in stores written before the choice was recorded.
    mask_token_id: int | None = None
    mask_token: str | None = None  # its token string; None for an embedding row no token maps to
    mask_token_source: str | None = None  # one of MASK_TOKEN_SOURCES
    supervise_reasoning: bool = True  # False: reasoning text is in the data but not in the loss
    # --regenerate and its sampling settings ({} when assistant turns are the data's own): a store
    # must not mix shards whose assistant turns came from different sources.
    regenerate: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        for key, default in _ADDED_LATER.items():  # absent when default: an older store's manifest
            if d[key] == default:                   # derives byte-identical
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StoreSettings":
        d = dict(d)
        d["target"] = TargetIdentity(**d["target"])
        d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
        return cls(**d)

    def bytes_per_token(self) -> int:
        """Raw tensor bytes per token: A*H*2 (bf16 aux) + k*(4 + logprob bytes)."""
        logprob_bytes = 2 if self.logprob_dtype == "float16" else 4
        return len(self.aux_layer_ids) * self.target.hidden_size * 2 + self.topk * (4 + logprob_bytes)


@dataclass(frozen=True, kw_only=True)
class ShardRecord:
    """The commit record of one shard: written last, by atomic rename, after both files are in place."""

    index: int
    parquet: str
    safetensors: str
    num_samples: int
    num_tokens: int
    parquet_bytes: int
    safetensors_bytes: int
    parquet_sha256: str
    safetensors_sha256: str
    input_file: str  # basename of the input file the shard's records came from
    first_record: int  # record range [first_record, end_record) of that file
    end_record: int
    num_records: int
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    num_truncated: int = 0
    backend: str = ""
    token_counts: dict[str, int] = field(default_factory=dict)  # "supervised.<kind>" / "unsupervised.<role>"
    num_supervised_turns: int = 0
    num_rendered_per_turn: int = 0  # records whose template rewrites history: one sample per turn

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["skipped"] = dict(sorted(self.skipped.items()))
        d["token_counts"] = dict(sorted(self.token_counts.items()))
        for key, default in _RECORD_ADDED_LATER.items():  # as StoreSettings.to_dict
            if d[key] == default:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShardRecord":
        return cls(**d)
