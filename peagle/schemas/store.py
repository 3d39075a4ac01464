"""The shard store's on-disk contract (docs/store.md): file names, columns, tensor names, records.

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
STORE_LOCK_FILE = ".lock"
"""The store lock (``flock``): serialises the read-modify-write of registrations, manifest and a first
run's ``store.json``."""

AUX_HIDDEN = "aux_hidden"  # [T, A, H]
TOPK_IDS = "topk_ids"  # [T, k]
TOPK_LOGPROBS = "topk_logprobs"  # [T, k]
# (shapes and dtypes: peagle.pipeline.shard_tensors.tensor_layout, the one place that knows them)
AUX_SCALE = "aux_scale"  # [T, A], fp8 stores only (peagle.pipeline.fp8)
TENSOR_NAMES = (AUX_HIDDEN, TOPK_IDS, TOPK_LOGPROBS)

PARQUET_COLUMNS = ("sample_id", "source", "input_ids", "loss_mask", "num_tokens", "token_offset")

# Token counts in commit records (``ShardRecord.token_counts``): "supervised.<kind>" and
# "unsupervised.<role>" (a message role, "template" or "unattributed").
SUPERVISED = "supervised"
UNSUPERVISED = "unsupervised"
OUTSIDE_ASSISTANT = "outside_assistant"  # a supervised token in another role's message: a wrong mask
SUPERVISED_KINDS = ("content", "reasoning", "tool_call", "end_of_turn", OUTSIDE_ASSISTANT)

# Keys of ``ShardRecord.skipped`` that count samples dropped from kept records, not records; every
# other key is a record's skip reason (extract's ``conversation.SKIP_REASONS``).
NON_FINITE_TARGET = "non_finite_target"  # the target's aux states or top-k for the sample hold NaN/inf
PER_TURN_TRUNCATED_NO_LOSS = "per_turn_truncated_no_loss"  # a per-turn sample cut to no supervised token
SAMPLE_DROPS = (NON_FINITE_TARGET, PER_TURN_TRUNCATED_NO_LOSS)

# How the mask token was chosen (``StoreSettings.mask_token_source``).
MASK_FROM_TOKENIZER = "tokenizer_mask_token"  # the tokenizer's own mask token
MASK_FROM_UNUSED_ROW = "unused_embedding_row"  # an embedding row beyond every id the tokenizer produces
MASK_FROM_RESERVED = "reserved_special_token"  # a reserved special token the template never writes
MASK_FROM_UNUSED_SPECIAL = "unused_special_token"  # another added special token the template never writes
MASK_FROM_FLAG = "explicit"  # --mask-token-id
MASK_TOKEN_SOURCES = (MASK_FROM_TOKENIZER, MASK_FROM_UNUSED_ROW, MASK_FROM_RESERVED, MASK_FROM_UNUSED_SPECIAL,
                      MASK_FROM_FLAG)


def describe_mask_token(token_id: int | None, token: str | None, source: str | None) -> str:
    """One line for plans and `peagle store info`: ``128255 <|reserved_special_token_247|> (...)``."""
    if token_id is None:
        return "none recorded (store written by an older peagle: pass --mask-token-id to train)"
    how = {
        MASK_FROM_TOKENIZER: "the tokenizer's mask token",
        MASK_FROM_UNUSED_ROW: "an embedding row past every id the tokenizer produces",
        MASK_FROM_RESERVED: "a reserved special token the chat template never writes",
        MASK_FROM_UNUSED_SPECIAL: "an added special token the chat template never writes",
        MASK_FROM_FLAG: "--mask-token-id",
    }.get(source or "", "how it was chosen is not recorded")
    return f"{token_id} {token if token is not None else '(no token)'} ({how})"


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
    content_hash: str  # sha256 over config.json and, per weight file, its name, size and byte samples
    # sha256 over config.json and, per weight file, its name, size and sha256: every tensor (peagle.model.
    # weights_hash). "" in stores written before it: they are matched by content_hash alone.
    weights_sha256: str = ""


HIDDEN_BF16 = "bf16"
HIDDEN_FP8 = "fp8"
HIDDEN_DTYPES = (HIDDEN_BF16, HIDDEN_FP8)
"""``aux_hidden`` encodings: bf16 states, or float8_e4m3fn codes with a float32 scale per
(token, layer) row in ``aux_scale`` (docs/fp8.md). Readers refuse any other value."""

_ADDED_LATER = {"mask_token": None, "mask_token_source": None, "supervise_reasoning": True,
                "hidden_dtype": HIDDEN_BF16}
_RECORD_ADDED_LATER = {"token_counts": {}, "num_supervised_turns": 0, "num_rendered_per_turn": 0, "stats": None,
                       "parquet_crc32": [], "safetensors_crc32": []}

CRC32_BLOCK_BYTES = 64 << 20
"""Shard files are checksummed in blocks of this many bytes (the last one shorter; an empty file has
one empty block): a reader checks the blocks it reads, the first time it reads them
(``peagle.pipeline.store.Store.check_content``), so a loader spreads the check over the batches that
read a shard instead of stalling on the whole file. 64 MiB keeps a 3 GB shard's record at ~50
checksums (the manifest holds every record) while one block stays under a batch's aux rows."""


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
    # --- How aux hidden states are encoded (HIDDEN_DTYPES) ---
    hidden_dtype: str = HIDDEN_BF16

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        # Fields added after the first stores are absent when at their default (bf16 for hidden_dtype):
        # an older store's manifest stays byte-identical, hence its hash, which checkpoints resume against.
        for key, default in _ADDED_LATER.items():
            if d[key] == default:
                del d[key]
        if not d["target"]["weights_sha256"]:  # as above: an older store's files stay byte-identical
            del d["target"]["weights_sha256"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StoreSettings":
        d = dict(d)
        d["target"] = TargetIdentity(**d["target"])
        d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
        return cls(**d)


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
    # --- Content statistics computed at commit time (None in records written before them) ---
    stats: ShardStats | None = None
    token_counts: dict[str, int] = field(default_factory=dict)  # "supervised.<kind>" / "unsupervised.<role>"
    num_supervised_turns: int = 0
    num_rendered_per_turn: int = 0  # records whose template rewrites history: one sample per turn
    # --- Content checksums: zlib's crc32 of each CRC32_BLOCK_BYTES block, 8 hex digits each (empty in
    # records written before them: such shards are checked by size only). crc32 runs at ~5 GB/s on one
    # core where sha256 (``peagle store verify``) runs at ~2: cheap enough to check every read by
    # default. It finds changed bytes, not someone who edits the record too. ---
    parquet_crc32: tuple[str, ...] = ()
    safetensors_crc32: tuple[str, ...] = ()

    @property
    def num_supervised_tokens(self) -> int:
        """The tokens a draft learns to predict (every ``supervised.<kind>`` count; 0 in records from
        before token counts)."""
        return sum(n for k, n in self.token_counts.items() if k.startswith(SUPERVISED + "."))

    @property
    def usable(self) -> bool:
        """Whether the shard holds a sample a draft learns from: one with a supervised token (records
        from before token counts: any sample). A store none of whose shards is usable is refused by
        every reader and started afresh by the next extract with other settings."""
        if not self.num_samples:
            return False
        return not self.token_counts or self.num_supervised_tokens > 0

    def crc32_of(self, rel: str) -> tuple[str, ...]:
        """The recorded block checksums of this shard's file ``rel`` (its ``parquet`` or ``safetensors``);
        empty when none were recorded."""
        return {self.parquet: self.parquet_crc32, self.safetensors: self.safetensors_crc32}[rel]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["skipped"] = dict(sorted(self.skipped.items()))
        d["token_counts"] = dict(sorted(self.token_counts.items()))
        d["parquet_crc32"], d["safetensors_crc32"] = list(self.parquet_crc32), list(self.safetensors_crc32)
        for key, default in _RECORD_ADDED_LATER.items():  # as StoreSettings.to_dict
            if d[key] == default:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShardRecord":
        d = dict(d)
        if d.get("stats") is not None:
            d["stats"] = ShardStats.from_dict(d["stats"])
        for key in ("parquet_crc32", "safetensors_crc32"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)


# --------------------------------------------------------------------------------------------------
# Commit-time content statistics (what `peagle store check` and `peagle train` judge a shard by)


@dataclass(frozen=True, kw_only=True)
class LayerStats:
    """One aux layer's rows in one shard, as stored (fp8: dequantised).

    The norm statistics cover the rows that are finite, not all zero and not a sample's first token:
    the first token carries the attention-sink "massive activations" of real LLMs, hundreds of times
    the typical norm, and would drown the distribution that outliers are judged against.
    """

    num_rows: int
    zero_rows: int  # every value exactly 0
    non_finite_rows: int  # some value NaN or inf
    norm_rows: int
    norm_mean: float
    norm_std: float
    norm_min: float
    norm_max: float
    log_norm_mean: float  # natural log of the L2 norm: outliers are judged on this scale
    log_norm_std: float


@dataclass(frozen=True, kw_only=True)
class TopkStats:
    """The shard's top-k rows: probability mass ``Σ exp(logprobs)`` and top-1 agreement."""

    num_rows: int
    non_finite_rows: int
    mass_high_rows: int  # Σ exp > 1 + MASS_TOLERANCE: not a log-softmax
    mass_low_rows: int  # Σ exp < k / (2V): below what any top-k of V probabilities can hold
    mass_mean: float
    mass_min: float
    mass_max: float
    agree_positions: int  # rows i whose next token x_{i+1} is supervised (loss_mask[i+1] = 1)
    agree_count: int  # of which topk_ids[i, 0] == x_{i+1}: the data's token is the target's top-1


MASS_TOLERANCE = 0.02
"""How far above 1 a stored top-k mass may be (float16 log-probs round by up to ~0.1% each)."""


@dataclass(frozen=True, kw_only=True)
class ShardStats:
    """Per-shard content statistics, in the commit record (``ShardRecord.stats``)."""

    version: int = 1
    layers: tuple[LayerStats, ...]  # in aux_layer_ids order
    topk: TopkStats

    @property
    def zero_rows(self) -> int:
        return sum(layer.zero_rows for layer in self.layers)

    @property
    def non_finite_rows(self) -> int:
        return sum(layer.non_finite_rows for layer in self.layers) + self.topk.non_finite_rows

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShardStats":
        return cls(version=d.get("version", 1), layers=tuple(LayerStats(**layer) for layer in d["layers"]),
                   topk=TopkStats(**d["topk"]))
