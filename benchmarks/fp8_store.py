"""FP8 store vs bf16 store of the same data: bytes per token, and reconstruction error per aux layer.

    python benchmarks/fp8_store.py --bf16-store /tmp/peagle-fp8-demo/bf16/store \\
        --out /tmp/peagle-bench-fp8 --json benchmarks/results/cpu/fp8_store.json

Two stores are measured:

* **the demo's store** (``--bf16-store``, e.g. what benchmarks/fp8_acceptance.py's bf16 demo
  extracted: real hidden states of the demo target, hidden 128, top-32), converted with ``peagle store
  convert`` (unless ``--fp8-store`` names its conversion already). Per aux layer, over every row
  (token): the relative error ``||x − x̂|| / ||x||`` of the fp8 row x̂ against the bf16 row x, mean,
  99th percentile and max; the same over each sample's first row only (the attention sink, whose
  massive activations make it the hardest row); and the largest error of a single value relative to
  its row's largest value;
* **an 8B-shaped store** (hidden 4096, aux layers 2/16/29, top-32 float16 log-probs: 24,768 raw
  bytes per token in bf16), written through the real writer from drawn rows shaped like hidden
  states (unit-normal channels, two channels 300x larger, first tokens 50x larger), then converted.
  Its bytes per token are those of any 8B-shaped store; its error is that of the drawn rows only.

Bytes per token are the committed files (Parquet + safetensors) over the tokens; ``raw`` is the
tensors' bytes alone (``shard_tensors.raw_bytes_per_token``).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from peagle.pipeline.store import init_store, open_store
from peagle.pipeline.raw_reader import iter_raw_shards
from peagle.pipeline.shard_tensors import raw_bytes_per_token, tensor_layout
from peagle.schemas import store as S
from peagle.model.target.backend import TargetOutput
from peagle.stages.store.convert import convert_store
from peagle.stages.extract.template import TokenizedSample
from peagle.stages.extract.writer import ShardContent, write_and_commit


def bytes_of(root: Path) -> dict:
    store = open_store(root)
    total = sum(r.parquet_bytes + r.safetensors_bytes for r in store.shards)
    layout = tensor_layout(store.settings, 1)
    aux = sum(torch.Size(shape).numel() * dtype.itemsize for name, (shape, dtype) in layout.items()
              if name in (S.AUX_HIDDEN, S.AUX_SCALE))
    return {"hidden_dtype": store.settings.hidden_dtype, "tokens": store.num_tokens, "bytes": total,
            "bytes_per_token": round(total / store.num_tokens, 2), "raw_bytes_per_token": raw_bytes_per_token(store.settings),
            "aux_bytes_per_token": aux}


def compare_bytes(bf16: Path, fp8: Path) -> dict:
    a, b = bytes_of(bf16), bytes_of(fp8)
    return {"bf16": a, "fp8": b, "ratio_on_disk": round(b["bytes_per_token"] / a["bytes_per_token"], 4),
            "ratio_raw": round(b["raw_bytes_per_token"] / a["raw_bytes_per_token"], 4),
            "ratio_aux": round(b["aux_bytes_per_token"] / a["aux_bytes_per_token"], 4)}


def reconstruction_error(bf16: Path, fp8: Path) -> dict:
    """Per aux layer: relative row error of the fp8 rows against the bf16 rows of the same store."""
    a_store, b_store = open_store(bf16), open_store(fp8)
    rows, first_rows, value = [], [], []
    for shard_a, shard_b in zip(iter_raw_shards(a_store), iter_raw_shards(b_store)):
        for sample_a, sample_b in zip(shard_a.samples(), shard_b.samples(), strict=True):
            xa, xb = sample_a.aux_nAH.float(), sample_b.aux_nAH.float()
            norm = torch.linalg.vector_norm(xa, dim=-1)
            err = torch.linalg.vector_norm(xa - xb, dim=-1) / norm.clamp_min(1e-30)
            rows.append(err.numpy())
            first_rows.append(err[:1].numpy())  # the attention sink's row
            value.append(((xa - xb).abs().amax(-1) / xa.abs().amax(-1).clamp_min(1e-30)).numpy())
    err_rA, first_rA, value_rA = (np.concatenate(x) for x in (rows, first_rows, value))
    out = {}
    for a, layer in enumerate(a_store.settings.aux_layer_ids):
        e = err_rA[:, a]
        out[str(layer)] = {"rows": int(e.size), "relative_error_mean": float(e.mean()),
                           "relative_error_p99": float(np.quantile(e, 0.99)), "relative_error_max": float(e.max()),
                           "first_row_relative_error_mean": float(first_rA[:, a].mean()),
                           "first_row_relative_error_max": float(first_rA[:, a].max()),
                           "value_error_max_of_row_max": float(value_rA[:, a].max())}
    return out


EIGHT_B = dict(hidden=4096, aux=(2, 16, 29), topk=32, vocab=128256, layers=32)


def synthetic_8b(root: Path, num_samples: int, tokens_per_sample: int) -> Path:
    """A bf16 store shaped like an 8B target's, written through the real writer (module docstring)."""
    if (root / S.MANIFEST_FILE).exists():
        return root
    settings = S.StoreSettings(
        target=S.TargetIdentity(path="synthetic-8b", architecture="LlamaForCausalLM", num_hidden_layers=EIGHT_B["layers"],
                                hidden_size=EIGHT_B["hidden"], vocab_size=EIGHT_B["vocab"], dtype="bfloat16",
                                content_hash="synthetic"),
        tokenizer_fingerprint="synthetic", chat_template_hash="synthetic", aux_layer_ids=EIGHT_B["aux"],
        topk=EIGHT_B["topk"], max_seq_len=tokens_per_sample, logprob_dtype="float16", loss_on="all")
    init_store(root, settings)
    g = torch.Generator().manual_seed(0)
    samples, outputs = [], []
    for i in range(num_samples):
        n = tokens_per_sample
        x = torch.randn(n, len(EIGHT_B["aux"]), EIGHT_B["hidden"], generator=g)
        x[..., 1234] *= 300.0
        x[..., 2048] *= -300.0
        x[0] *= 50.0  # the attention sink
        logits = torch.randn(n, 2048, generator=g) * 3
        top = logits.log_softmax(-1).topk(EIGHT_B["topk"])
        samples.append(TokenizedSample(sample_id=f"s{i}", source=f"synthetic:{i}",
                                       input_ids=torch.randint(0, EIGHT_B["vocab"], (n,), generator=g).tolist(),
                                       loss_mask=[0] * (n // 4) + [1] * (n - n // 4)))
        outputs.append(TargetOutput(aux_TAH=x.to(torch.bfloat16), topk_ids_TK=top.indices.int(),
                                    topk_logprobs_TK=top.values))
    write_and_commit(root, ShardContent(index=0, input_name="synthetic", first_record=0, end_record=num_samples,
                                        samples=samples, outputs=outputs, backend="synthetic"), settings)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bf16-store", required=True, help="a bf16 store (the demo's)")
    parser.add_argument("--fp8-store", default=None, help="its fp8 conversion (default: converted under --out)")
    parser.add_argument("--out", default="/tmp/peagle-bench-fp8", help="where converted and synthetic stores go")
    parser.add_argument("--json", default=None, help="write results here (default: stdout only)")
    parser.add_argument("--synthetic-samples", type=int, default=4)
    parser.add_argument("--synthetic-tokens", type=int, default=1024)
    args = parser.parse_args()
    out = Path(args.out)
    started = time.perf_counter()
    fp8 = Path(args.fp8_store) if args.fp8_store else out / "demo-fp8"
    if not args.fp8_store:
        convert_store(args.bf16_store, fp8, S.HIDDEN_FP8, progress=False)
    bf16_8b = synthetic_8b(out / "synthetic-8b-bf16", args.synthetic_samples, args.synthetic_tokens)
    convert_store(bf16_8b, out / "synthetic-8b-fp8", S.HIDDEN_FP8, progress=False)
    result = {
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "demo_store": {"bf16": str(Path(args.bf16_store).resolve()), "fp8": str(fp8.resolve()),
                       "bytes": compare_bytes(Path(args.bf16_store), fp8),
                       "reconstruction_error_per_layer": reconstruction_error(Path(args.bf16_store), fp8)},
        "synthetic_8b_store": {"bytes": compare_bytes(bf16_8b, out / "synthetic-8b-fp8"),
                               "reconstruction_error_per_layer": reconstruction_error(bf16_8b, out / "synthetic-8b-fp8")},
        "seconds": round(time.perf_counter() - started, 1),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
