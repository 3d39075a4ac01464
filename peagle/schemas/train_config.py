"""The configuration of one `peagle train` run, one component config per part (torchtitan's shape).

The parts: ``data`` (:class:`DataSettings`: stores, evaluation split, loader budget and workers),
``cod`` (:class:`CodSettings`: K and the COD draw), ``optim`` (:class:`OptimizerSettings`) and
``checkpoint`` (:class:`CheckpointSettings`); the draft's shape, the step's kernels and the run's length
are fields of the config itself. Each part validates its own fields and is handed whole to what builds
that part (the loader's stream config, the optimizer, the checkpointer); checks across parts are here.

Every plain field, in a part or not, is one `peagle train` flag of its name (its docstring the
help), and the names are unique across the parts (:mod:`peagle.schemas.components`), so flags,
``--config`` files and the saved ``train_config`` stay one flat mapping: :meth:`TrainConfig.to_dict`
writes it and :meth:`TrainConfig.from_dict` reads it, the same keys runs written before the parts
existed hold. Validation happens before any model, store or process group is touched; checks that
need the target or the store (hidden size, aux layers, vocab) happen where those are opened. A
resumed run compares the saved mapping leaf by leaf (:func:`peagle.schemas.train_resume.config_mismatch`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from peagle.schemas.checkpoint_settings import CheckpointSettings
from peagle.schemas.cod_settings import PEAGLE_ONLY_COD, CodSettings
from peagle.schemas.components import from_flat, leaves, to_flat
from peagle.schemas.data_settings import DataSettings, StoreSpec, parse_store_spec
from peagle.schemas.draft_config import DRAFT_ARCHITECTURES, DRAFT_METHODS
from peagle.schemas.dtypes import dtype_choice
from peagle.schemas.errors import UserError, at_least
from peagle.schemas.optimizer_settings import OptimizerSettings
from peagle.schemas.tracking_config import TrackingOptions

ATTENTION_BACKENDS = ("auto", "flex", "sdpa")
COMPILE_MODES = ("auto", "layers", "flex", "off")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
FLEX_KERNELS = ("auto", "rows-safe", "tma", "flash")
LOSSES = ("forward_kl", "tv")
PEAGLE_ONLY = (*PEAGLE_ONLY_COD, "mask_token_id")
"""Fields of P-EAGLE's COD sampling and mask slots: `--method eagle3` refuses them set (it trains every
chain and has no mask slots)."""

__all__ = ["TrainConfig", "StoreSpec", "parse_store_spec", "PEAGLE_ONLY", "DataSettings", "CodSettings",
           "OptimizerSettings", "CheckpointSettings"]
"""``StoreSpec`` and ``parse_store_spec`` live with the data part; they are named here too, where the
stores' readers have always imported them from."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig(TrackingOptions):
    """Settings of `peagle train` (docs/cod.md, docs/draft-and-export.md, docs/reliability.md): data, draft shape, optimisation, run mechanics
    (and the experiment trackers of :class:`TrackingOptions`)."""

    data: DataSettings
    """The stores trained and evaluated on and how the loader reads them (--store, --eval-store,
    --token-budget, --num-workers, --follow, ...)."""

    target: str
    """Directory of the target model the stores were extracted from (config, weights, tokenizer):
    the draft takes its shape, embeddings and lm_head rows from it."""

    out: str
    """Run directory: metrics.jsonl, checkpoints/ and run.json go here (and bad_steps.jsonl, if a step
    was not finite). Re-running the same command resumes from the latest checkpoint in it. One run at
    a time: a running one holds RUN_DIR/.lock, and a second is refused naming its pid and host."""

    method: str = "peagle"
    """Training method (docs/methods.md): `peagle` (P-EAGLE: the draft proposes all K tokens in one
    forward, from mask slots; trained with COD sampling) or `eagle3` (EAGLE-3 with training-time
    test: one forward per token, each reading the draft's previous hidden state; trained by unrolling
    K steps over every chain). `peagle export` writes the format vLLM serves for it."""

    cod: CodSettings = dataclasses.field(default_factory=CodSettings)
    """K and P-EAGLE's COD draw of the deeper depths (--num-depths, --down-sample-ratio,
    --down-sample-ratio-min, --max-anchors)."""

    sequence_partitions: int = 1
    """S: split each sample's COD sequence into S segments, one forward+backward each (exact: same
    loss and gradients as S=1). A unit holds 1/S of the deeper-depth elements but the depth-0 context up
    to its segment, so peak activation memory falls toward that of the depth-0 row, not to 1/S. For long
    contexts (docs/mask.md)."""

    attention: str = "auto"
    """Attention backend: `flex` (flex_attention with a block mask; needs CUDA for training), `sdpa`
    (dense boolean mask), or `auto` (flex on CUDA, sdpa on CPU)."""

    compile: str = "auto"
    """What torch.compile compiles: `layers` (each decoder layer whole, flex attention inside, and the
    loss's per-chunk pass), `flex` (flex attention alone), `off`, or `auto` (layers on CUDA, off
    elsewhere). A layer that fails to compile falls back to `flex`, with one line saying why."""

    flex_kernel: str = "auto"
    """Kernel options of flex attention: `auto` (torch's choice), `rows-safe` (skip the guards for
    fully masked rows, which training rows never have), `tma` (rows-safe and Hopper's bulk copies), or
    `flash` (the FlashAttention-4 backend; needs flash_attn.cute installed). benchmarks/attention.py
    times them on the P-EAGLE mask."""

    fp8_matmuls: bool = False
    """Run the decoder layers' q/k/v/o and MLP matmuls in fp8 (torchao rowwise Float8Linear; needs
    torchao: pip install 'peagle[fp8]'). Master weights, the head and attention stay as they are."""

    compute_dtype: str = "auto"
    """Autocast dtype of the draft's forward and loss: `auto` (bfloat16 on CUDA and on CPUs with
    native bf16 matmuls, AVX512-BF16 or AMX; float32 on other CPUs), `float32` or `bfloat16`. Weights,
    optimizer states and gradient reductions stay float32 either way. On this project's CPUs bf16 ran
    the demo's step 1.19x as fast as float32 and reached the same held-out acceptance within seed
    noise (benchmarks/train_precision.py). Fixed for a run's life."""

    num_layers: int = 4
    """Draft decoder layers (layer 0 reads [embeddings, fc(aux)]; the rest are plain decoder layers)."""

    draft_architecture: str = "llama"
    """Draft decoder type: `llama`, or `qwen3` (RMSNorm on every query and key head before RoPE, as
    Qwen3 does). Either is exported in the format vLLM serves with parallel drafting."""

    norm_before_residual: bool = True
    """EAGLE-3.1 option (on by default, like the two below: together they raised acceptance beyond
    seed noise on the toy target, README "Draft quality"): layer 0's residual is hidden_norm(fc(aux)) instead of fc(aux)."""

    norm_before_fc: bool = True
    """EAGLE-3.1 option: one RMSNorm over the concatenated aux hidden states before fc (also on
    mask_hidden, as vLLM applies it)."""

    fc_norm: bool = True
    """EAGLE-3.1 option: one RMSNorm per aux layer on its hidden state before fc (after the
    --norm-before-fc norm when both are on)."""

    max_steps: int | None = None
    """Stop after this many optimizer steps (exclusive with --epochs). Default: one epoch."""

    epochs: float | None = None
    """Stop after this many passes over the training data (exclusive with --max-steps)."""

    seed: int = 0
    """Run seed: draft init, data order and every COD draw derive from it."""

    draft_vocab_size: int | None = None
    """Draft vocabulary size: the most frequent supervised target tokens, as built by `peagle vocab
    STORE --draft-vocab-size N` on the first --store. Default: the one vocabulary `peagle vocab` built
    there; with none built, the target's vocab when that is at most 32000 (no mapping); with several,
    name one."""

    mask_token_id: int | None = None
    """Token id of a P-EAGLE draft's mask slots. Default: the one `peagle extract` chose and recorded in
    the store (`peagle store info` shows it); a different value is refused. Only needed for a store
    written by an older peagle that recorded none (it is then checked against all stored tokens)."""

    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank. Global batch = world size x grad_accum x
    token_budget tokens."""

    optim: OptimizerSettings = dataclasses.field(default_factory=OptimizerSettings)
    """The optimizer, its learning rates and schedule (--optimizer, --lr, --muon-lr, --warmup-steps, ...)."""

    loss: str = "forward_kl"
    """Training loss per element against the stored top-k, renormalised over the draft vocab:
    `forward_kl` (KL(target || draft)) or `tv` (total variation distance, 1 - the acceptance
    probability of speculative sampling). See docs/loss.md for what the untracked tail does to each."""

    aux_noise: float = 0.0
    """Gaussian noise on the target's aux states in training (not in --eval-store's evaluation), its
    standard deviation this fraction of each state's RMS (0: none). EAGLE-1 trained on noised
    features so the draft tolerates its own feature errors; here it is a regulariser against a draft
    that learns a small store by heart (docs/quality.md). Drawn from the run's checkpointed RNG, so a
    resumed run draws what the killed one would have."""

    eval_every: int = 500
    """Evaluate every this many optimizer steps, and at the end (0: never)."""

    checkpoint: CheckpointSettings = dataclasses.field(default_factory=CheckpointSettings)
    """When checkpoints are written and how many are kept (--save-every, --keep-checkpoints)."""

    max_bad_steps: int = 3
    """How many steps with a non-finite (NaN or inf) loss or gradient norm the run survives. Such a step
    is not applied (the weights and optimizer state stay as they were) and its samples are recorded in
    RUN_DIR/bad_steps.jsonl; one more stops the run in one line naming the stores, shards and sample
    ids, after a checkpoint of the last good weights. A few stray samples are survivable; many mean
    the store or the settings are broken, and training on would waste the run. Counted over the
    whole run, resumes included."""

    log_every: int = 10
    """Write a metrics.jsonl line (and refresh the progress bar) every this many optimizer steps."""

    train_lm_head: bool = False
    """Also train lm_head (by default it keeps the target's rows, frozen, as in the reference)."""

    train_embeddings: bool = True
    """Train embed_tokens (P-EAGLE's choice; it starts as the target's). `--no-train-embeddings` keeps
    the target's embedding frozen, as EAGLE-3 drafts do: on little data a trained embedding moves
    the tokens it sees away from the ones it does not."""

    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward: less memory, about 1/3 more compute."""

    fsdp: bool = False
    """Under torchrun, shard parameters, gradients and optimizer state with FSDP2 instead of
    replicating them with DDP (for drafts that do not fit one device with their optimizer state)."""

    init_from: str | None = None
    """Warm-start from an exported P-EAGLE or EAGLE-3 draft directory (`peagle export` output, or a
    speculators checkpoint): every tensor whose name and shape match is copied (the draft vocab must be
    the same); the rest keep their usual start (the target's embeddings and lm_head, random layers)."""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_BACKENDS:
            raise UserError(f"--attention must be one of {'|'.join(ATTENTION_BACKENDS)}, got {self.attention!r}")
        object.__setattr__(self, "compute_dtype", dtype_choice("compute-dtype", self.compute_dtype, COMPUTE_DTYPES))
        if self.compile not in COMPILE_MODES:
            raise UserError(f"--compile must be one of {'|'.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.flex_kernel not in FLEX_KERNELS:
            raise UserError(f"--flex-kernel must be one of {'|'.join(FLEX_KERNELS)}, got {self.flex_kernel!r}")
        if self.draft_architecture not in DRAFT_ARCHITECTURES:
            raise UserError(f"--draft-architecture must be one of {'|'.join(DRAFT_ARCHITECTURES)}, "
                            f"got {self.draft_architecture!r}")
        if self.max_steps is not None and self.epochs is not None:
            raise UserError(f"--max-steps {self.max_steps} and --epochs {self.epochs} are exclusive; pass one")
        if self.data.follow and self.max_steps is None:
            raise UserError("--follow needs --max-steps: the length of an epoch is not known before the store is "
                            "complete, so --epochs cannot size the run")
        if self.method not in DRAFT_METHODS:
            raise UserError(f"--method must be one of {'|'.join(DRAFT_METHODS)}, got {self.method!r}")
        if self.method != "peagle":
            self._check_eagle3()
        for name in ("sequence_partitions", "num_layers", "grad_accum", "log_every"):
            at_least(name, getattr(self, name), 1)
        for name in ("eval_every", "seed", "max_bad_steps"):
            at_least(name, getattr(self, name), 0)
        for name in ("max_steps", "draft_vocab_size", "mask_token_id"):
            if getattr(self, name) is not None:
                at_least(name, getattr(self, name), 0 if name == "mask_token_id" else 1)
        if self.epochs is not None and not (math.isfinite(self.epochs) and self.epochs > 0):
            raise UserError(f"--epochs must be > 0, got {self.epochs}")
        if not (math.isfinite(self.aux_noise) and self.aux_noise >= 0):
            raise UserError(f"--aux-noise must be >= 0, got {self.aux_noise}")
        if self.optim.optimizer == "muon" and self.fsdp:
            raise UserError("--fsdp needs --optimizer adamw: Muon (the default optimizer) orthogonalises whole "
                            "matrices and FSDP2 shards them; add --optimizer adamw, or drop --fsdp to use DDP")
        if self.loss not in LOSSES:
            raise UserError(f"--loss must be one of {'|'.join(LOSSES)}, got {self.loss!r}")
        self.check_tracking()

    def _check_eagle3(self) -> None:
        """What --method eagle3 does not take: P-EAGLE's COD and mask-token settings (it trains every
        chain, from the draft's own hidden states), and FSDP2 (its unrolled steps call the decoder
        layers' ``step``, which FSDP2's per-layer hooks do not wrap)."""
        defaults, values = {leaf.name: leaf.field.default for leaf in leaves(TrainConfig)}, to_flat(self)
        peagle_only = [name for name in PEAGLE_ONLY if values[name] != defaults[name]]
        if peagle_only:
            flags = ", ".join(f"--{name.replace('_', '-')}" for name in peagle_only)
            raise UserError(f"{flags} {'is' if len(peagle_only) == 1 else 'are'} P-EAGLE's (--method peagle): "
                            "--method eagle3 trains every chain and has no mask slots; leave "
                            f"{'it' if len(peagle_only) == 1 else 'them'} out")
        if self.fsdp:
            raise UserError("--fsdp is not offered with --method eagle3 (its unrolled steps bypass FSDP2's "
                            "per-layer hooks); train it with DDP (torchrun without --fsdp)")

    # ----------------------------------------------------------------------------------------------

    @classmethod
    def from_flags(cls, **values: Any) -> "TrainConfig":
        """The config of these flag values, named as the flags' fields (``store=``, ``lr=``,
        ``num_depths=``): each goes to its part, the rest keep their defaults. A part may be given
        whole instead (``cod=CodSettings(...)``)."""
        return from_flat(cls, values)

    def to_dict(self) -> dict[str, Any]:
        """The flat mapping of every flag's value, JSON-able (``store`` as a list): what ``run.json``
        and ``config.pt`` hold, in the keys they held before the parts existed. Inverse of :meth:`from_dict`."""
        d = to_flat(self)
        d["store"] = list(self.data.store)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        """A saved :meth:`to_dict` (of this or an earlier peagle, whose keys are the same flat names).

        Raises:
            UserError: a key that is no flag of this peagle, or a value its checks refuse.
        """
        known = {leaf.name for leaf in leaves(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"train config: unknown key {unknown[0]!r}")
        d = dict(data)
        if "store" in d:
            d["store"] = tuple(d["store"])
        return from_flat(cls, d)
