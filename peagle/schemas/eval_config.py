"""The configuration of one `peagle eval` run: every CLI flag is a field, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass

from peagle.schemas.dtypes import dtype_choice
from peagle.schemas.errors import UserError
from peagle.schemas.tracking_config import TrackingOptions

EVAL_MODES = ("offline", "online", "vllm")
"""The modes that run on this machine alone (`peagle demo --eval-modes` takes these)."""
SERVER_MODE = "server"
"""The mode that measures a running vLLM server (needs --server URL; peagle/stages/eval/server.py)."""
ALL_EVAL_MODES = (*EVAL_MODES, SERVER_MODE)
TARGET_DTYPES = ("float32", "bfloat16", "float64")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class EvalConfig(TrackingOptions):
    """Settings of `peagle eval` (docs/draft-and-export.md): what to measure, on which prompts, how to decode."""

    source: str
    """Training run directory, checkpoint directory, or export directory (a run or checkpoint is first
    exported into OUT/export, so every mode measures exactly what vLLM serves)."""

    target: str | None = None
    """Target model directory (HF layout). Default: the verifier named in the export, if it is a local
    directory."""

    store: str | None = None
    """Store for offline chains and prompts. Default: the run's --eval-store, else the held-out
    samples of its first training store (none if that store is not on this machine)."""

    prompts: str | None = None
    """Prompts file: JSONL lines with `messages`, `prompt` or `prompt_token_ids`, or a .txt file of user
    messages. Default: the store's samples up to their first assistant reply, else a few built-in ones."""

    num_depths: int | None = None
    """K: draft tokens per step (all modes), up to the draft's trained depths for a P-EAGLE draft (8 for
    one trained at --num-depths 8; an EAGLE-3 draft takes more). The step costs and the K
    recommendation cover K = 1 up to it. Default: the export's speculative_tokens."""

    concurrency: tuple[int, ...] | None = None
    """Comma list of concurrencies to time vLLM at besides one request at a time and every prompt at
    once (e.g. 4,8: the prompts in waves of 4, then of 8, at once), the target alone likewise.
    Default: none."""

    mode: tuple[str, ...] | None = None
    """Comma list of offline,online,vllm,server. Default: every mode that can run here (offline needs a
    store, vllm needs vLLM); with --server: server and online (the reference its acceptance is judged
    against), offline with a store, no in-process vllm (the server holds the accelerator)."""

    server: str | None = None
    """URL of a running vLLM server of this export (`vllm serve EXPORT_DIR`, e.g. http://localhost:8000):
    mode server sends it the same prompts (/v1/completions, token ids, greedy) and reads acceptance from
    its /metrics before and after. Those counters are server-wide: measure a server nobody else is using
    (other requests in between are detected and refused). vLLM does not publish whether it drafts in
    parallel; the report judges it by comparing with the online/vllm modes (docs/usage.md)."""

    server_timeout: float = 30.0
    """Seconds one request to --server may take, from connecting to the last byte of its answer
    (/v1/models, /metrics; the one /v1/completions request of every prompt gets 1800 s, or this if
    longer): a server that answers slower, or drips its answer, is given up on in one line."""

    out: str | None = None
    """Report directory (report.json + PNG plots). Default: RUN_DIR/eval, or EXPORT_DIR-eval."""

    temperature: float = 0.0
    """0: greedy (outputs must equal plain decoding); > 0: sampling with the standard rejection rule."""

    max_new_tokens: int = 64
    """Tokens generated per prompt (own loop and vLLM)."""

    max_prompts: int = 8
    """Prompts decoded (own loop and vLLM)."""

    max_samples: int = 64
    """Store samples evaluated offline."""

    seed: int = 0
    """Sampling seed (prompt i uses seed + i)."""

    target_dtype: str = "float32"
    """dtype of target and draft in the own loop (float32, bfloat16 or float64); vLLM runs bfloat16
    for bfloat16, else float32."""

    vllm_compile: bool = False
    """Serve vLLM compiled (torch.compile, `enforce_eager=False`: vLLM's own default and its fastest
    setting), the draft's engine and the target's alone both. On 2 CPU cores it decodes ~1.4x faster
    than eager one request at a time, after a ~90 s compile per engine. Default: eager, which starts
    in seconds."""

    online_compile: bool = False
    """Compile the own loop's target (torch.compile of the transformers model, dynamic shapes), for its
    plain decoding and its verification alike: the target's fastest setting in transformers. On 2 CPU
    cores SmolLM2 decodes ~1.4x faster than eager one request at a time, after ~1-3 minutes of
    compile. The draft runs eager either way. Default: eager."""

    device: str = "auto"
    """Device of the own loop: auto (cuda if available), cpu or cuda."""

    ignore_eos: bool = False
    """Always generate --max-new-tokens tokens (no stop tokens)."""

    quiet: bool = False
    """No progress bars."""

    def __post_init__(self) -> None:
        if self.mode is not None:
            unknown = sorted(set(self.mode) - set(ALL_EVAL_MODES))
            if unknown or not self.mode:
                raise UserError(f"--mode takes a comma list of {','.join(ALL_EVAL_MODES)}, got {','.join(self.mode)}")
            if SERVER_MODE in self.mode and not self.server:
                raise UserError("--mode server measures a running vLLM server: pass its URL, --server http://HOST:PORT")
            if self.server and SERVER_MODE not in self.mode:
                raise UserError(f"--server {self.server} is measured by mode server, which --mode "
                                f"{','.join(self.mode)} leaves out: add server to --mode")
        if self.server is not None:
            if not self.server.startswith(("http://", "https://")):
                raise UserError(f"--server takes the server's base URL, http://HOST:PORT, got {self.server!r}")
            if self.temperature > 0:
                raise UserError(f"--server measures greedy decoding (temperature 0, as the server's acceptance "
                                f"is compared with our loop's), got --temperature {self.temperature:g}")
        if not self.server_timeout > 0:
            raise UserError(f"--server-timeout must be > 0 seconds, got {self.server_timeout}")
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0, got {self.temperature}")
        for name in ("max_new_tokens", "max_prompts", "max_samples"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.num_depths is not None and self.num_depths < 1:
            raise UserError(f"--num-depths must be >= 1, got {self.num_depths}")
        if self.concurrency is not None and (not self.concurrency or min(self.concurrency) < 1):
            raise UserError(f"--concurrency takes a comma list of request counts >= 1, got "
                            f"{','.join(map(str, self.concurrency))}")
        if self.device not in DEVICES:
            raise UserError(f"--device must be one of {'|'.join(DEVICES)}, got {self.device!r}")
        object.__setattr__(self, "target_dtype", dtype_choice("target-dtype", self.target_dtype, TARGET_DTYPES))
        self.check_tracking()
