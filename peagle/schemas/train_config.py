"""The configuration of one `peagle train` run: every CLI flag is a field, its docstring the help.

Validation happens here, before any model, store or process group is touched.
Checks that need the target or the store (hidden size, aux layers, vocab) happen where those are
opened. A checkpoint stores ``to_dict()``; resuming compares it field by field
(:func:`peagle.schemas.train_resume.config_mismatch`) and refuses a change, except for the fields in
``SAFE_TO_CHANGE``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

from peagle.schemas.draft_config import DRAFT_ARCHITECTURES, DRAFT_METHODS
from peagle.schemas.dtypes import dtype_choice
from peagle.schemas.errors import UserError
from peagle.schemas.tracking_config import TrackingOptions

ATTENTION_BACKENDS = ("auto", "flex", "sdpa")
COMPILE_MODES = ("auto", "layers", "flex", "off")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
FLEX_KERNELS = ("auto", "rows-safe", "tma", "flash")
OPTIMIZERS = ("adamw", "muon")
MUON_NS_DTYPES = ("float32", "bfloat16")
LOSSES = ("forward_kl", "tv")
PEAGLE_ONLY = ("down_sample_ratio", "down_sample_ratio_min", "max_anchors", "mask_token_id")
"""Fields of P-EAGLE's COD sampling and mask slots: `--method eagle3` refuses them set (it trains every
chain and has no mask slots)."""

__all__ = ["TrainConfig", "StoreSpec", "parse_store_spec", "PEAGLE_ONLY"]


@dataclass(frozen=True)
class StoreSpec:
    """One training store and its mixing weight (``PATH`` or ``PATH:WEIGHT``)."""

    path: str
    weight: float = 1.0


def parse_store_spec(text: str) -> StoreSpec:
    """``/data/a`` -> (``/data/a``, 1.0); ``/data/a:0.7`` -> (``/data/a``, 0.7).

    Only a suffix that parses as a number is a weight, so paths that contain ``:`` still work.
    """
    path, sep, tail = str(text).rpartition(":")
    if sep and path:
        try:
            weight = float(tail)
        except ValueError:
            return StoreSpec(str(text), 1.0)
        if not (math.isfinite(weight) and weight > 0):
            raise UserError(f"--store {text}: the weight after ':' must be a positive number, got {tail!r}")
        return StoreSpec(path, weight)
    return StoreSpec(str(text), 1.0)


@dataclass(frozen=True, kw_only=True)
class TrainConfig(TrackingOptions):
    """Settings of `peagle train` (docs/cod.md, docs/draft-and-export.md, docs/reliability.md): data, draft shape, optimisation, run mechanics
    (and the experiment trackers of :class:`TrackingOptions`)."""

    store: tuple[str, ...]
    """Shard store(s) written by `peagle extract`, as STORE or STORE:WEIGHT. Repeat the flag to mix
    stores: each batch draws samples from store i with probability weight_i / sum(weights)."""

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

    num_depths: int = 8
    """K: how many tokens the draft proposes per step (depths 0..K-1 are trained): in one forward
    (peagle), or in K forwards, the steps eagle3 unrolls."""

    down_sample_ratio: float = 0.7
    """r: COD sampling keeps a fraction max(r^d, r_min) of the supervised positions at depth d
    (--method peagle; eagle3 trains every chain)."""

    down_sample_ratio_min: float = 0.2
    """r_min: the floor of the per-depth COD keep fraction (--method peagle)."""

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

    lr: float = 1e-4
    """Peak learning rate of the AdamW updates (after warmup; cosine decay to 10% of it by the last
    step): with Muon (the default optimizer), of the parameters outside the decoder layers' matrices
    (--muon-lr is theirs); with --optimizer adamw, of every parameter."""

    seed: int = 0
    """Run seed: draft init, data order and every COD draw derive from it."""

    eval_store: str | None = None
    """Store to evaluate on every --eval-every steps. Without it, a --heldout-fraction of the
    training samples (chosen by sample_id hash) is held out for evaluation."""

    draft_vocab_size: int | None = None
    """Draft vocabulary size: the most frequent supervised target tokens, as built by `peagle vocab
    STORE --draft-vocab-size N` on the first --store. Default: the one vocabulary `peagle vocab` built
    there; with none built, the target's vocab when that is at most 32000 (no mapping); with several,
    name one."""

    mask_token_id: int | None = None
    """Token id of a P-EAGLE draft's mask slots. Default: the one `peagle extract` chose and recorded in
    the store (`peagle store info` shows it); a different value is refused. Only needed for a store
    written by an older peagle that recorded none (it is then checked against all stored tokens)."""

    token_budget: int = 16384
    """Training positions per micro-batch on each rank: samples (n tokens give n - 1 positions) are
    packed into one row up to this; COD then adds the deeper-depth elements on top."""

    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank. Global batch = world size x grad_accum x
    token_budget tokens."""

    warmup_steps: int = 100
    """Linear learning-rate warmup from 0 over this many optimizer steps."""

    weight_decay: float = 0.01
    """Decoupled weight decay on 2-D weights except embed_tokens (with --optimizer muon, on Muon's
    matrices too, each scaled by its own learning rate)."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 turns clipping off)."""

    optimizer: str = "muon"
    """`muon` (default): Muon (momentum orthogonalised by Newton-Schulz) at --muon-lr on the decoder
    layers' 2-D weights (attention and MLP projections), AdamW at --lr on the rest (embeddings, fc,
    lm_head, norms, mask_hidden); it raised acceptance length 12% over AdamW at the same steps
    on the toy target (benchmarks/quality.py, README "Draft quality"). `adamw`: AdamW on every parameter at --lr;
    the one --fsdp supports."""

    muon_lr: float = 0.02
    """Peak learning rate of Muon's matrices with --optimizer muon (warmup and cosine decay as --lr,
    so the two keep their ratio). Muon's step has a fixed spectral size, so it needs a larger rate
    than AdamW's: on the quality benchmark 0.02 to 0.1 did alike and 0.01 lost Muon's gain."""

    muon_ns_dtype: str = "float32"
    """Dtype of Muon's Newton-Schulz iterations with --optimizer muon: `float32`, or `bfloat16` (what
    Muon's authors run: the five iterations only need singular values near 1, and bf16 keeps them within
    ~3 %). A cost per optimizer step, not per token: a large share of a deep draft's CPU step
    (benchmarks/train_step_profile.py); bf16 matmuls run faster where the CPU has AVX512-BF16 or AMX."""

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

    max_anchors: int | None = None
    """(--method peagle) Cap M on the draft chains of each sample: at most M of its positions start a chain (get
    depth 1 elements); every deeper element extends one of those chains, and the deeper depths'
    counts shrink by the factor that capped depth 1. A sample of T positions then adds at most
    M x (K-1) elements to its T depth-0 ones. Per sample, also when samples are packed into one
    row. Default: no cap."""

    eval_every: int = 500
    """Evaluate every this many optimizer steps, and at the end (0: never)."""

    save_every: int = 1000
    """Write a checkpoint every this many optimizer steps, and at the end (0: only at the end)."""

    keep_checkpoints: int = 3
    """How many of the newest checkpoints to keep (older ones are deleted once a new one commits); the
    newest checkpoint whose weights are all finite is kept as well, however old."""

    max_bad_steps: int = 3
    """How many steps with a non-finite (NaN or inf) loss or gradient norm the run survives. Such a step
    is not applied (the weights and optimizer state stay as they were) and its samples are recorded in
    RUN_DIR/bad_steps.jsonl; one more stops the run in one line naming the stores, shards and sample
    ids, after a checkpoint of the last good weights. A few stray samples are survivable; many mean
    the store or the settings are broken, and training on would waste the run. Counted over the
    whole run, resumes included."""

    log_every: int = 10
    """Write a metrics.jsonl line (and refresh the progress bar) every this many optimizer steps."""

    num_workers: int = 2
    """DataLoader worker processes per rank doing COD sampling, packing and mask metadata (0: in
    the training process)."""

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

    heldout_fraction: float = 0.01
    """Share of training samples held out for evaluation when no --eval-store is given (0: none)."""

    verify: bool = False
    """Check the sha256 of every shard when opening the stores (default: sizes only)."""

    allow_bad_aux_rows: bool = False
    """Train on stores whose commit statistics show all-zero or non-finite aux rows (by default such
    a store is refused, naming the shard: `peagle store check --store STORE` finds the samples)."""

    allow_incomplete: bool = False
    """Train on stores with planned shards that are not committed (a worker died, or is still at work),
    saying how much is missing; by default such a store is refused, naming the missing shards
    (`peagle store info --store STORE` prints the command that extracts them)."""

    follow: bool = False
    """Train while extraction still commits into the stores: start once a shard is committed; each epoch
    covers the shards committed when it begins (while a store is incomplete, a new epoch waits for a new
    commit rather than repeat the same data). Needs --max-steps; the draft vocab is the one built before
    the run starts (`peagle vocab --store STORE --allow-incomplete`), frozen for the run. RUN_DIR/epochs.json
    records the shards of every epoch; a store still incomplete when the steps are spent is an error
    (after the final checkpoint) unless --allow-incomplete."""

    follow_timeout: float = 3600.0
    """With --follow: seconds to wait for the first (or a next) committed shard before giving up with one
    line naming the missing shards (re-running the same command then resumes)."""

    epoch_shards: str | None = None
    """Train epoch e on exactly the shards FILE records for it (the RUN_DIR/epochs.json of a --follow run;
    epochs it does not list cover every committed shard): repeats that run's consumption on the
    finished store, step for step."""

    def __post_init__(self) -> None:
        store = (self.store,) if isinstance(self.store, str) else tuple(self.store or ())
        object.__setattr__(self, "store", store)
        if not store:
            raise UserError("no training store: pass --store PATH (or PATH:WEIGHT; repeat to mix stores)")
        self.stores()  # validates weights
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
        if self.follow and self.max_steps is None:
            raise UserError("--follow needs --max-steps: the length of an epoch is not known before the store is "
                            "complete, so --epochs cannot size the run")
        if self.follow and self.epoch_shards is not None:
            raise UserError("--follow and --epoch-shards are exclusive: --epoch-shards repeats a finished --follow run")
        if not (math.isfinite(self.follow_timeout) and self.follow_timeout > 0):
            raise UserError(f"--follow-timeout must be > 0 seconds, got {self.follow_timeout}")
        if self.method not in DRAFT_METHODS:
            raise UserError(f"--method must be one of {'|'.join(DRAFT_METHODS)}, got {self.method!r}")
        if self.method != "peagle":
            self._check_eagle3()
        for name in ("num_depths", "sequence_partitions", "num_layers", "token_budget", "grad_accum",
                     "log_every", "keep_checkpoints"):
            _at_least(name, getattr(self, name), 1)
        for name in ("warmup_steps", "eval_every", "save_every", "num_workers", "seed", "max_bad_steps"):
            _at_least(name, getattr(self, name), 0)
        for name in ("max_steps", "max_anchors", "draft_vocab_size", "mask_token_id"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 0 if name == "mask_token_id" else 1)
        if self.epochs is not None and not (math.isfinite(self.epochs) and self.epochs > 0):
            raise UserError(f"--epochs must be > 0, got {self.epochs}")
        if not 0 < self.down_sample_ratio <= 1:
            raise UserError(f"--down-sample-ratio must be in (0, 1], got {self.down_sample_ratio}")
        if not 0 <= self.down_sample_ratio_min <= 1:
            raise UserError(f"--down-sample-ratio-min must be in [0, 1], got {self.down_sample_ratio_min}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise UserError(f"--lr must be > 0, got {self.lr}")
        if not (math.isfinite(self.aux_noise) and self.aux_noise >= 0):
            raise UserError(f"--aux-noise must be >= 0, got {self.aux_noise}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise UserError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise UserError(f"--grad-clip must be >= 0 (0 = off), got {self.grad_clip}")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"--optimizer must be one of {'|'.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if not (math.isfinite(self.muon_lr) and self.muon_lr > 0):
            raise UserError(f"--muon-lr must be > 0, got {self.muon_lr}")
        if self.muon_ns_dtype not in MUON_NS_DTYPES:
            raise UserError(f"--muon-ns-dtype must be one of {'|'.join(MUON_NS_DTYPES)}, got {self.muon_ns_dtype!r}")
        if self.optimizer == "muon" and self.fsdp:
            raise UserError("--fsdp needs --optimizer adamw: Muon (the default optimizer) orthogonalises whole "
                            "matrices and FSDP2 shards them; add --optimizer adamw, or drop --fsdp to use DDP")
        if self.loss not in LOSSES:
            raise UserError(f"--loss must be one of {'|'.join(LOSSES)}, got {self.loss!r}")
        if not 0 <= self.heldout_fraction < 1:
            raise UserError(f"--heldout-fraction must be in [0, 1), got {self.heldout_fraction}")
        self.check_tracking()

    def _check_eagle3(self) -> None:
        """What --method eagle3 does not take: P-EAGLE's COD and mask-token settings (it trains every
        chain, from the draft's own hidden states), and FSDP2 (its unrolled steps call the decoder
        layers' ``step``, which FSDP2's per-layer hooks do not wrap)."""
        defaults = {f.name: f.default for f in fields(self)}
        peagle_only = [name for name in PEAGLE_ONLY if getattr(self, name) != defaults[name]]
        if peagle_only:
            flags = ", ".join(f"--{name.replace('_', '-')}" for name in peagle_only)
            raise UserError(f"{flags} {'is' if len(peagle_only) == 1 else 'are'} P-EAGLE's (--method peagle): "
                            "--method eagle3 trains every chain and has no mask slots; leave "
                            f"{'it' if len(peagle_only) == 1 else 'them'} out")
        if self.fsdp:
            raise UserError("--fsdp is not offered with --method eagle3 (its unrolled steps bypass FSDP2's "
                            "per-layer hooks); train it with DDP (torchrun without --fsdp)")

    # ----------------------------------------------------------------------------------------------

    def stores(self) -> list[StoreSpec]:
        """The training stores with their weights, in the order given."""
        return [parse_store_spec(s) for s in self.store]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able; ``store`` as a list. Inverse of :meth:`from_dict`."""
        d = dataclasses.asdict(self)
        d["store"] = list(self.store)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"train config: unknown key {unknown[0]!r}")
        d = dict(data)
        if "store" in d:
            d["store"] = tuple(d["store"])
        return cls(**d)


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise UserError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
