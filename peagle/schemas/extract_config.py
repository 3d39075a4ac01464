"""The configuration of one `peagle extract` run: every CLI flag is a field, its docstring the help.

Validation happens here, before any model or file is touched (typed configs checked
before work starts). Checks that need the target (the aux layer ids against its layer count) live in
``resolve_aux_layer_ids``, which the driver calls once it has read the target's config.
"""

from __future__ import annotations

from dataclasses import dataclass

from peagle.schemas.dtypes import dtype_choice
from peagle.schemas.errors import UserError
from peagle.schemas.store import HIDDEN_DTYPES

BACKENDS = ("auto", "vllm", "hf")
LOSS_ON = ("all", "last", "per_turn")
DTYPES = ("auto", "float32", "bfloat16")
LOGPROB_DTYPES = ("float16", "float32")
DEVICES = ("auto", "cpu", "cuda")
GENERATION_MODES = ("auto", "dynamic", "static", "compiled")
"""The hf backend's KV cache for generation (peagle/model/target/hf_backend.py says what each costs)."""

MAX_RECORD_BYTES = 4 << 20
"""Default of ``--max-record-bytes``. A chat is ~4 bytes a token, so 4 MiB is ~1 M tokens, several times
the longest context a target reads; a record past it would be cut to ``--max-seq-len`` anyway, after
costing gigabytes to decode and render (one 5 MB record lifted extract's peak memory from ~0.5 to ~2.3 GB)."""


@dataclass(frozen=True, kw_only=True)
class ExtractConfig:
    """Settings of `peagle extract` (docs/store.md): inputs, target, store, and how to run the target."""

    data: tuple[str, ...]
    """Input chat files (JSONL or Parquet; OpenAI `messages` or ShareGPT `conversations`). Repeat the
    flag or list several paths. Each file becomes its own run of shards, in the order given."""

    target: str
    """Directory of the target model (Hugging Face layout: config.json, weights, tokenizer)."""

    out: str
    """The shard store to create or to continue (several workers may write into it at once)."""

    backend: str = "auto"
    """Target backend: `vllm`, `hf` (transformers), or `auto` (= vllm when it imports, else hf)."""

    aux_layers: tuple[int, ...] | None = None
    """Layer ids whose entering hidden state is stored (the HF `output_hidden_states` index), strictly ascending,
    each in [1, N) for an N-layer target, e.g. `2,8,13`. Default: `2,N//2,N-3`."""

    topk: int = 32
    """How many of the target's top log-probabilities to store per token."""

    max_seq_len: int = 2048
    """Samples longer than this many tokens are truncated (and counted)."""

    samples_per_shard: int = 256
    """Records per shard: each input file is cut into shards of this many consecutive records (a
    record with several assistant turns may give several samples with `--loss-on per_turn`)."""

    shard_index: int = 0
    """This worker's index in [0, num_shards): it takes every global shard s with s % num_shards ==
    shard_index."""

    num_shards: int = 1
    """Number of workers the shards are split over (one process per GPU/node, or an array job)."""

    strict: bool = False
    """Fail on the first malformed record (one line naming file and line) instead of skipping it."""

    dry_run: bool = False
    """Print the plan (records, estimated tokens and store size, free disk) and stop. It decodes and
    checks every record it counts (--strict applies), and fails as a real run would on bad input."""

    max_skipped_share: float = 0.5
    """Fail (exit 2, naming the first bad records and why) when more than this share of the records a
    run reads are skipped as unusable; 1 never fails on skips. A run that reads no usable record, or
    commits no supervised token, fails whatever this says."""

    max_record_bytes: int = MAX_RECORD_BYTES
    """A record (a JSONL line, a Parquet row) of more bytes than this is skipped and counted as
    `too_large` without being decoded, so one giant record cannot take the process's memory; 0: no bound.
    Default 4 MiB (~1 M tokens of text)."""

    replace_changed_inputs: bool = False
    """An input file whose content changed since the store registered it is refused (its old shards
    would stay beside the new ones, every unchanged record twice); with this, its old shards are
    dropped and it is extracted again. Needs the store to itself (no other extract running on it)."""

    loss_on: str = "all"
    """Which assistant turns are supervised: `all`, `last` (the last one only), or `per_turn` (one
    sample per assistant turn, each supervising that turn). With `all`, a record whose chat template
    rewrites earlier turns (Qwen3 drops their reasoning) becomes one sample per turn, each rendered
    as the target sees it when writing that turn."""

    supervise_reasoning: bool = True
    """Supervise the reasoning text of assistant turns as the chat template renders it (`<think>`
    blocks from `reasoning_content` or a `<think>...</think>` prefix). `--no-supervise-reasoning`
    keeps it in the context but out of the loss (the template's delimiters stay supervised)."""

    mask_token_id: int | None = None
    """Token id the draft feeds into its parallel-drafting (mask) slots; it must never occur in the
    data, and records that contain it are skipped and counted. Default: chosen from the target --
    the tokenizer's mask token, else an embedding row past the tokenizer's ids (Qwen-style padded
    vocab), else the highest reserved special token the chat template never writes, else the highest
    other special token it never writes (docs/mask.md). Recorded in the store (`peagle store info`
    shows it); train and export take it from there."""

    dtype: str = "auto"
    """Compute dtype of the target: `float32`, `bfloat16`, or `auto` (bfloat16 on GPU, float32 on
    CPU). Part of the store's identity: a store is extracted with one dtype."""

    logprob_dtype: str = "float16"
    """Storage dtype of the top-k log-probabilities: `float16` (k*6 bytes/token) or `float32`."""

    hidden_dtype: str = "bf16"
    """Storage of the aux hidden states: `bf16` (A*H*2 bytes/token) or `fp8` (float8_e4m3fn with a
    float32 scale per token and layer, A*(H+4) bytes/token: about half the disk, and half the bytes
    read per training batch). Part of the store's identity; docs/fp8.md has the error it costs."""

    device: str = "auto"
    """Where the hf backend runs the target: `cpu`, `cuda`, or `auto` (cuda when available)."""

    batch_size: int = 8
    """Samples per forward pass (hf backend). Batches are a fixed function of each shard's samples,
    so results are bit-identical across runs."""

    max_batch_tokens: int = 16384
    """Upper bound on padded tokens (samples x longest sample) in one forward pass."""

    threads: int = 0
    """CPU threads for torch (0 = torch's default). Fix it when byte-identical shards across
    machines matter: CPU matmul results may depend on the thread count."""

    regenerate: bool = False
    """Replace every assistant turn with the target's own response before extraction, so the draft
    learns the target's own distribution (hf: transformers generate; vllm: vLLM generate)."""

    temperature: float = 0.7
    """Sampling temperature for `--regenerate` (0 = greedy)."""

    top_p: float = 0.95
    """Nucleus-sampling top-p for `--regenerate`."""

    max_new_tokens: int = 512
    """Longest regenerated assistant turn, in tokens (`--regenerate`)."""

    generation_dtype: str = "auto"
    """`--regenerate`: the dtype the target writes its answers in: hf a bf16 copy of the model, vllm
    its generating engine. `auto`: bfloat16 where a float32 target runs on a CPU with native bf16
    matmuls (AVX512-BF16, AMX; ~1.5x faster there, drafts trained on its answers accept as much:
    docs/quality.md), else --dtype. Its greedy text parts from float32's (on SmolLM2 at token 38
    in the median): `float32` to write what a float32 target serves. The aux states and top-k
    always come from --dtype."""

    generation_batch_size: int = 0
    """hf backend, `--regenerate`: prompts generated together (0: 64 on CPU, 1024 on CUDA). Larger
    batches make more tokens per second until memory or the longest answer of a batch dominates."""

    generation: str = "auto"
    """hf backend, `--regenerate`: the KV cache of generation. `dynamic` (transformers' growing
    cache), `static` (preallocated, written in place: the fast one for large batches on a GPU),
    `compiled` (static plus a compiled decode step with CUDA graphs: pays for small batches, costs a
    compile per run), or `auto` (static on CUDA, dynamic on CPU)."""

    seed: int = 0
    """Sampling seed for `--regenerate`; each shard draws from its own generator seeded by (seed,
    shard index), so re-runs and any worker split regenerate the same text."""

    tensor_parallel_size: int = 1
    """vllm backend: GPUs one extract worker spreads the target over (vLLM tensor parallelism); give the
    worker that many GPUs (e.g. `--gpus-per-task` in SLURM)."""

    gpu_memory_utilization: float = 0.0
    """vllm backend: share of each GPU's memory vLLM may take (0: vLLM's default)."""

    vllm_engine_args: str = ""
    """vllm backend: further `vllm.LLM` keyword arguments as a JSON object, passed through unchanged
    (they win over peagle's own), e.g. '{"max_num_seqs": 64}'."""

    def vllm_engine_kwargs(self) -> dict:
        """``--vllm-engine-args`` parsed (validated in ``__post_init__``)."""
        import json

        return json.loads(self.vllm_engine_args) if self.vllm_engine_args else {}

    def __post_init__(self) -> None:
        if not self.data:
            raise UserError("no input data: pass --data PATH (one or more JSONL or Parquet files)")
        _choice("backend", self.backend, BACKENDS)
        _choice("loss-on", self.loss_on, LOSS_ON)
        for name, allowed in (("dtype", DTYPES), ("logprob_dtype", LOGPROB_DTYPES), ("hidden_dtype", HIDDEN_DTYPES)):
            object.__setattr__(self, name, dtype_choice(_flag(name), getattr(self, name), allowed))
        _choice("device", self.device, DEVICES)
        _choice("generation", self.generation, GENERATION_MODES)
        object.__setattr__(self, "generation_dtype", dtype_choice("generation-dtype", self.generation_dtype, DTYPES))
        if self.generation_batch_size < 0:
            raise UserError(f"--generation-batch-size must be >= 0 (0: automatic), got {self.generation_batch_size}")
        for name in ("topk", "max_seq_len", "samples_per_shard", "num_shards", "batch_size",
                     "max_batch_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len < 2:
            raise UserError(f"--max-seq-len must be >= 2 (a sample needs a next token), got {self.max_seq_len}")
        if not 0 <= self.shard_index < self.num_shards:
            raise UserError(f"--shard-index must be in [0, {self.num_shards}) for --num-shards "
                            f"{self.num_shards}, got {self.shard_index}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise UserError(f"--mask-token-id must be >= 0, got {self.mask_token_id}")
        if self.threads < 0:
            raise UserError(f"--threads must be >= 0, got {self.threads}")
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0, got {self.temperature}")
        if self.max_record_bytes < 0:
            raise UserError(f"--max-record-bytes must be >= 0 (0: no bound), got {self.max_record_bytes}")
        if not 0 <= self.max_skipped_share <= 1:
            raise UserError(f"--max-skipped-share must be in [0, 1], got {self.max_skipped_share}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.aux_layers is not None:
            check_aux_layer_ids(self.aux_layers)
        if self.tensor_parallel_size < 1:
            raise UserError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 <= self.gpu_memory_utilization <= 1:
            raise UserError(f"--gpu-memory-utilization must be in [0, 1], got {self.gpu_memory_utilization}")
        try:
            engine_args = self.vllm_engine_kwargs()
        except ValueError as err:
            raise UserError(f"--vllm-engine-args is not valid JSON: {err}") from err
        if not isinstance(engine_args, dict):
            raise UserError(f"--vllm-engine-args must be a JSON object, got {self.vllm_engine_args!r}")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"--{flag} must be one of {'|'.join(allowed)}, got {value!r}")


def check_aux_layer_ids(ids: tuple[int, ...], num_layers: int | None = None) -> None:
    """Strictly ascending, no repeats, each in [1, N) (docs/store.md: vLLM sorts and de-duplicates the ids
    and then expects exactly that many states, so anything else would silently misalign)."""
    if not ids:
        raise UserError("--aux-layers must name at least one layer")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise UserError(f"--aux-layers must be strictly ascending with no repeats, got {','.join(map(str, ids))}")
    if ids[0] < 1:
        raise UserError(f"--aux-layers ids must be >= 1 (0 is the embedding output), got {ids[0]}")
    if num_layers is not None and ids[-1] >= num_layers:
        raise UserError(f"--aux-layers id {ids[-1]} is out of range for a target with {num_layers} layers "
                        f"(ids must be in [1, {num_layers}))")


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """``[2, N//2, N-3]`` (EAGLE-3's low, middle and high layer)."""
    return (2, num_layers // 2, num_layers - 3)


def resolve_aux_layer_ids(config: ExtractConfig, num_layers: int) -> tuple[int, ...]:
    """The run's aux layer ids for an N-layer target (the default needs N >= 7 to be distinct)."""
    ids = config.aux_layers if config.aux_layers is not None else default_aux_layer_ids(num_layers)
    if config.aux_layers is None and num_layers < 7:
        raise UserError(f"the target has {num_layers} layers: the default aux layers 2,N//2,N-3 are not "
                        "distinct; pass --aux-layers")
    check_aux_layer_ids(ids, num_layers)
    return ids
