"""The configuration of one `peagle prompts` run: every CLI flag is a field, its docstring the help.

Validation happens here, before the target is loaded. ``--out`` names a file, not a directory as in
the other verbs, so its checks (an existing directory, an existing file) are made here, where they
come before the CLI's directory check and say what this verb means.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from peagle.schemas.dtypes import dtype_choice
from peagle.schemas.errors import UserError

BACKENDS = ("auto", "hf", "vllm")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True, kw_only=True)
class PromptsConfig:
    """Settings of `peagle prompts` (docs/prompts.md): the target, the output, sampling and the filters."""

    target: str
    """Directory of the target model (Hugging Face layout: config.json, weights, tokenizer with a chat
    template). It writes the prompts itself."""

    out: str
    """The JSONL file to write: one prompt-only chat record per line, {"messages": [{"role": "user",
    "content": ...}]}, ready for `peagle extract --data FILE --regenerate`. Written whole at the end;
    an existing file is refused, never written over."""

    num_prompts: int = 1000
    """How many prompts to write (each distinct and past every filter)."""

    seed: int = 0
    """Sampling seed. Round r samples with a seed derived from (seed, r): the same seed, backend and
    batch size write the same file."""

    temperature: float = 1.0
    """Sampling temperature of the user messages (> 0: greedy decoding writes one prompt over and over)."""

    top_p: float = 1.0
    """Nucleus-sampling top-p of the user messages."""

    max_new_tokens: int = 128
    """Longest user message sampled, in tokens; one that reaches it without ending its turn is dropped
    (counted as truncated)."""

    batch_size: int = 64
    """Samples per round (one generate call). 64 suits a CPU; a GPU wants 512-2048 (vLLM schedules them
    continuously, hf pads them into one batch)."""

    backend: str = "auto"
    """Target backend: `vllm`, `hf` (transformers), or `auto` (= vllm when it imports, else hf, as
    `peagle extract`). On a CPU vLLM is several times faster than hf in float32."""

    device: str = "auto"
    """Where the hf backend runs the target: `cpu`, `cuda`, or `auto` (cuda when available)."""

    dtype: str = "auto"
    """Compute dtype of the target: `float32`, `bfloat16`, or `auto` (hf: bfloat16 on GPU, float32 on
    CPU, where a CPU with native bf16 matmuls samples from a bf16 copy, as `extract --regenerate`
    writes its answers by default; vllm: its own choice)."""

    threads: int = 0
    """CPU threads for torch (0 = torch's default). Fix it when the same file across machines matters:
    CPU matmul results, and so the samples, may depend on the thread count."""

    min_words: int = 3
    """Drop samples of fewer words (a CJK character counts as one word)."""

    max_words: int = 150
    """Drop samples of more words."""

    request_filter: bool = True
    """Keep only samples that read as a request: a question mark, or a first word that asks or
    instructs (what, how, can, please, write, explain, I, my, ...). `--no-request-filter` keeps the
    rest too (a target that writes non-English prompts without question marks needs it)."""

    exclude_phrases: str | None = None
    """A text file of phrases, one per line: a sample that contains any of them (case-insensitive, as
    whole words) is dropped. Keeps held-out subjects (an eval set's topics, names) out of training."""

    exclude_prompts: str | None = None
    """A JSONL or Parquet file of chat records (e.g. an eval set) whose first user messages are held
    out: a sample equal to one of them, ignoring case, punctuation and spacing, is dropped."""

    max_samples_factor: float = 10.0
    """Give up after sampling this many times --num-prompts (in whole rounds) without keeping them all:
    a target that keeps repeating itself, or filters that reject what it writes, end in one line
    naming the drop reasons instead of sampling forever. Nothing is written then."""

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_new_tokens", "batch_size", "min_words"):
            if getattr(self, name) < 1:
                raise UserError(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.max_words < self.min_words:
            raise UserError(f"--max-words {self.max_words} is below --min-words {self.min_words}")
        if not self.temperature > 0:
            raise UserError(f"--temperature must be > 0 (greedy decoding writes the same prompt every time), "
                            f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.threads < 0:
            raise UserError(f"--threads must be >= 0, got {self.threads}")
        if not self.max_samples_factor >= 1:
            raise UserError(f"--max-samples-factor must be >= 1, got {self.max_samples_factor}")
        _choice("backend", self.backend, BACKENDS)
        _choice("device", self.device, DEVICES)
        object.__setattr__(self, "dtype", dtype_choice("dtype", self.dtype, DTYPES))
        out = Path(self.out)
        if out.is_dir():
            raise UserError(f"--out {out} is a directory; --out names the JSONL file to write")
        if out.exists():  # a finished run's prompts cost hours of sampling: never written over
            raise UserError(f"--out {out} exists; remove it or name another file")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"--{flag} must be one of {'|'.join(allowed)}, got {value!r}")
