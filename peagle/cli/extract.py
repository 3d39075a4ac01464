"""``peagle extract``: parse flags into an ``ExtractConfig`` and run the extract stage (thin)."""

from __future__ import annotations

from typing import Optional

import typer

from peagle.cli import app
from peagle.cli.config_file import ConfigOption
from peagle.schemas import extract_config as X

_DOC = X.field_docs(X.ExtractConfig)


def _choice(values: tuple[str, ...]) -> str:
    """Choices shown as the metavar; ExtractConfig rejects anything else in one line."""
    return "|".join(values)


@app.command("extract")
def extract(
    data: Optional[list[str]] = typer.Option(None, "--data", help=_DOC["data"], metavar="PATH"),
    more_data: Optional[list[str]] = typer.Argument(None, metavar="PATH", show_default=False,
                                                    help="More input files (so `--data a.jsonl b.jsonl` works)."),
    target: str = typer.Option(..., "--target", help=_DOC["target"], metavar="MODEL_DIR"),
    out: str = typer.Option(..., "--out", help=_DOC["out"], metavar="STORE"),
    backend: str = typer.Option("auto", "--backend", help=_DOC["backend"], metavar=_choice(X.BACKENDS)),
    aux_layers: Optional[str] = typer.Option(None, "--aux-layers", help=_DOC["aux_layers"], metavar="IDS"),
    topk: int = typer.Option(32, "--topk", help=_DOC["topk"]),
    max_seq_len: int = typer.Option(2048, "--max-seq-len", help=_DOC["max_seq_len"]),
    samples_per_shard: int = typer.Option(256, "--samples-per-shard", help=_DOC["samples_per_shard"]),
    shard_index: int = typer.Option(0, "--shard-index", help=_DOC["shard_index"]),
    num_shards: int = typer.Option(1, "--num-shards", help=_DOC["num_shards"]),
    strict: bool = typer.Option(False, "--strict", help=_DOC["strict"]),
    dry_run: bool = typer.Option(False, "--dry-run", help=_DOC["dry_run"]),
    loss_on: str = typer.Option("all", "--loss-on", help=_DOC["loss_on"], metavar=_choice(X.LOSS_ON)),
    supervise_reasoning: bool = typer.Option(True, "--supervise-reasoning/--no-supervise-reasoning",
                                             help=_DOC["supervise_reasoning"]),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", help=_DOC["mask_token_id"], metavar="ID",
                                                show_default=False),
    dtype: str = typer.Option("auto", "--dtype", help=_DOC["dtype"], metavar=_choice(X.DTYPES)),
    logprob_dtype: str = typer.Option("float16", "--logprob-dtype", help=_DOC["logprob_dtype"],
                                      metavar=_choice(X.LOGPROB_DTYPES)),
    device: str = typer.Option("auto", "--device", help=_DOC["device"], metavar=_choice(X.DEVICES)),
    batch_size: int = typer.Option(8, "--batch-size", help=_DOC["batch_size"]),
    max_batch_tokens: int = typer.Option(16384, "--max-batch-tokens", help=_DOC["max_batch_tokens"]),
    threads: int = typer.Option(0, "--threads", help=_DOC["threads"]),
    regenerate: bool = typer.Option(False, "--regenerate", help=_DOC["regenerate"]),
    temperature: float = typer.Option(0.7, "--temperature", help=_DOC["temperature"]),
    top_p: float = typer.Option(0.95, "--top-p", help=_DOC["top_p"]),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help=_DOC["max_new_tokens"]),
    seed: int = typer.Option(0, "--seed", help=_DOC["seed"]),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", help=_DOC["tensor_parallel_size"]),
    gpu_memory_utilization: float = typer.Option(0.0, "--gpu-memory-utilization",
                                                 help=_DOC["gpu_memory_utilization"]),
    vllm_engine_args: str = typer.Option("", "--vllm-engine-args", help=_DOC["vllm_engine_args"], metavar="JSON"),
    config: Optional[str] = ConfigOption,
) -> None:
    """Run the target over chat data and write the shard store (aux hidden states + top-k log-probs).

    Prints the plan first (records, estimated tokens and store size, free disk). Re-running the same
    command finishes what is missing; several workers (--shard-index/--num-shards) may write into one
    store at once.
    """
    from peagle.stages.extract.run import run_extract

    cfg = X.ExtractConfig(
        data=tuple(data or ()) + tuple(more_data or ()), target=target, out=out, backend=backend,
        aux_layers=X.parse_int_list(aux_layers), topk=topk, max_seq_len=max_seq_len,
        samples_per_shard=samples_per_shard, shard_index=shard_index, num_shards=num_shards, strict=strict,
        dry_run=dry_run, loss_on=loss_on, supervise_reasoning=supervise_reasoning, mask_token_id=mask_token_id,
        dtype=dtype, logprob_dtype=logprob_dtype, device=device,
        batch_size=batch_size, max_batch_tokens=max_batch_tokens, threads=threads, regenerate=regenerate,
        temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed,
        tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
        vllm_engine_args=vllm_engine_args,
    )
    run_extract(cfg, echo=typer.echo)
