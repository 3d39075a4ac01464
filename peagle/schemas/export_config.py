"""The configuration of one `peagle export` run: every CLI flag is a field, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass

from peagle.schemas.dtypes import dtype_choice
from peagle.schemas.errors import UserError
from peagle.schemas.speculative_schedule import parse_schedule

EXPORT_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """Settings of `peagle export` (docs/draft-and-export.md)."""

    source: str
    """Training run directory (its newest valid checkpoint is exported), one checkpoint directory
    (RUN_DIR/checkpoints/step-N), or an export written without the target's embedding (it holds
    target_embedding.json; give --target to make it whole again)."""

    out: str
    """Export directory to create (an existing export there is replaced whole; anything else there
    is refused)."""

    verifier_name: str | None = None
    """Verifier recorded in the export and served by `LLM(model=OUT)`. Default: the target path
    given to training; a hub-style name (org/model) makes the export portable."""

    speculative_tokens: int | None = None
    """K: draft tokens vLLM proposes per step (up to 8 and more: a P-EAGLE draft serves K = 1 up to its
    trained depths, an EAGLE-3 draft any K). Default: the trained number of depths."""

    speculative_schedule: str | None = None
    """A K per batch size, e.g. `1:5,2-8:0` (K 5 one request at a time, no drafting from 2 requests on;
    the last range's K holds for larger batches), as `peagle eval` writes it (its report's
    k_recommendation.schedule), carried in the export's peagle section for vLLM's
    num_speculative_tokens_per_batch_size (docs/performance.md). Each K is 0..--speculative-tokens;
    a P-EAGLE draft takes only its served K or 0 (vLLM 0.32's parallel drafting)."""

    target: str | None = None
    """Target model directory whose embedding a SOURCE written without it gets back: its rows are
    checked against the recorded sha256, so another target is refused."""

    without_target_embedding: bool = False
    """Write the export without `embed_tokens` when the draft kept the target's, frozen (trained with
    `--no-train-embeddings`; most of a small draft's bytes), and record its sha256 in
    target_embedding.json: the form that travels. `peagle export OUT --target T --out DIR` makes it
    whole again."""

    dtype: str = "float32"
    """Weight dtype in model.safetensors: float32 (lossless) or bfloat16 (half the size; vLLM casts to
    the served dtype anyway)."""

    max_file_mib: float | None = None
    """Weights larger than this many MiB are written as shards of at most that size,
    model-00001-of-0000N.safetensors and model.safetensors.index.json, as transformers shards a
    checkpoint; vLLM, speculators and peagle load either form. For a draft git or a size-capped
    transfer holds (the committed drafts use 15). Default: one model.safetensors."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_choice("dtype", self.dtype, EXPORT_DTYPES))
        if self.max_file_mib is not None and not self.max_file_mib > 0:
            raise UserError(f"--max-file-mib must be > 0, got {self.max_file_mib}")
        if self.speculative_tokens is not None and self.speculative_tokens < 1:
            raise UserError(f"--speculative-tokens must be >= 1, got {self.speculative_tokens}")
        if self.speculative_schedule is not None:
            parse_schedule(self.speculative_schedule)  # its form now; its Ks once the draft is known
