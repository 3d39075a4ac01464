"""`peagle train` end to end through the real CLI (on a store made by the extract and vocab stages): train,
kill -9, resume, errors, a variant run and its export.

A run killed with SIGKILL (failpoints mid-step and mid-checkpoint-write, docs/reliability.md) and started again
with the same command must end with the same per-step losses and the same final weights as a run
that was never interrupted.

Each command is a child of the fault suite's warm fork server (the real entry point in its own process, as
in every fault-suite trial); `peagle train` through the console script in a fresh interpreter is run by
tests/cli/test_help.py (every help example, torchrun's too) and a cold fault-suite trial.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable

import pytest
import torch

from peagle.testing.warm_cli import Result

TIMING = ("tokens_per_s", "data_wait_share", "step_time_s")


@pytest.fixture(scope="module")
def peagle(cli_runner) -> Callable[..., Result]:
    """``peagle(*args, env=...)`` runs `peagle ARGS` to its end as a child of the session's warm fork
    server (peagle/testing/warm_cli.py): the real entry point in a process of its own, which a failpoint
    kills as it would the console script, without ~4 s of imports per command."""
    return lambda *args, env=None: cli_runner.run(*args, env=env, timeout=600)


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llama):
    """A real store of the tiny Llama with a 200-token draft vocab, made by the stages `peagle extract`
    and `peagle vocab` run (in this process: the commands themselves are tests/test_cli_extract.py's and
    tests/test_cli_vocab.py's; here only `peagle train` is under test)."""
    from peagle.schemas.extract_config import ExtractConfig
    from peagle.stages.extract.run import run_extract
    from peagle.stages.train.vocab import build_draft_vocab
    from peagle.testing.chat_data import write_chat_jsonl

    root = tmp_path_factory.mktemp("cli_train")
    data = write_chat_jsonl(root / "chat.jsonl", 24, seed=3)
    run_extract(ExtractConfig(data=(str(data),), target=str(tiny_llama), out=str(root / "store"), samples_per_shard=6,
                              backend="hf", device="cpu", max_seq_len=256), echo=lambda _: None, progress=False)
    build_draft_vocab(root / "store", 200, echo=lambda _: None)
    return root / "store"


def train_args(store, target, out, *extra: str) -> list[str]:
    return ["train", "--store", store, "--target", target, "--out", out, "--max-steps", "6", "--num-layers", "1",
            "--num-depths", "4", "--token-budget", "256", "--draft-vocab-size", "200", "--lr", "2e-3",
            "--warmup-steps", "1", "--log-every", "1", "--save-every", "2", "--eval-every", "3",
            "--heldout-fraction", "0.2", "--num-workers", "1", *extra]


def losses(out) -> list[tuple]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["kind"], r["step"], {k: v for k, v in r.items() if k not in TIMING}) for r in records]


def final_weights(out) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoints" / "step-00000006" / "model.pt")


@pytest.fixture(scope="module")
def straight(store, tiny_llama, tmp_path_factory, peagle):
    out = tmp_path_factory.mktemp("straight") / "run"
    proc = peagle(*train_args(store, tiny_llama, out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.slow
def test_train_writes_metrics_and_checkpoints(straight):
    records = losses(straight)
    assert [(kind, step) for kind, step, _ in records] == [
        ("train", 1), ("train", 2), ("train", 3), ("eval", 3), ("train", 4), ("train", 5), ("train", 6), ("eval", 6)]
    assert all({"loss", "depth_loss", "depth_agreement", "depth_count"} <= set(r) for _, _, r in records)
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == [
        "step-00000002", "step-00000004", "step-00000006"]


@pytest.mark.slow
def test_kill_9_then_the_same_command_gives_the_same_run(store, tiny_llama, straight, tmp_path, peagle):
    """Killed inside a checkpoint write, then (the same command, resumed) killed mid-step: the same
    command a third time ends with the uninterrupted run's metrics, eval included, and weights.

    Each resumed process's output is kept and compared: the first resume writes steps 3-4, the eval at
    step 3 and the step-4 checkpoint the last one resumes from."""
    out = tmp_path / "run"
    args = train_args(store, tiny_llama, out)
    # the 3rd of the 7 files of the step-4 checkpoint: step 2 is the newest whole one, a temp directory is left
    killed = peagle(*args, env={"PEAGLE_FAILPOINT": "train.checkpoint_write:10"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")], "no temp directory left"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")) == ["step-00000002"]
    # resumed at step 3, it dies in its 3rd step (step 5), after writing the step-4 checkpoint
    killed = peagle(*args, env={"PEAGLE_FAILPOINT": "train.step:3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert "resumed from" in killed.stderr and "step-00000002" in killed.stderr, killed.stderr[-2000:]
    resumed = peagle(*args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr and "step-00000004" in resumed.stderr, resumed.stderr[-2000:]
    assert losses(out) == losses(straight)
    a, b = final_weights(straight), final_weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # no temp left


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    (["--attention", "fast"], "--attention must be one of auto|flex|sdpa, got 'fast'"),
    (["--epochs", "1"], "--max-steps 6 and --epochs 1.0 are exclusive"),
    (["--draft-vocab-size", "300"], "has no draft vocab of size 300; build it with `peagle vocab"),
])
def test_user_errors_are_one_line(extra, message, store, tiny_llama, tmp_path, peagle):
    proc = peagle(*train_args(store, tiny_llama, tmp_path / "run", *extra))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("peagle: error: ") and message in lines[0], proc.stderr


@pytest.mark.slow
def test_a_store_from_another_target_is_refused(store, tiny_qwen3, tmp_path, peagle):
    proc = peagle(*train_args(store, tiny_qwen3, tmp_path / "run"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "was extracted from a target with architecture LlamaForCausalLM, --target has architecture " \
           "Qwen3ForCausalLM" in proc.stderr


@pytest.mark.slow
def test_a_variant_run_trains_exports_and_resumes_only_as_itself(store, tiny_llama, tmp_path, peagle):
    """The issue-13 variants through the real CLI at once: a Qwen3-style draft with every norm option,
    Muon and the TV loss trains, its export reads back as the same variant, and a resume that turns a
    variant off is refused in one line (the checkpoint would not fit another architecture)."""
    from peagle.model.speculators_format import load_export

    out, export = tmp_path / "run", tmp_path / "export"
    variant = ["--draft-architecture", "qwen3", "--norm-before-residual", "--norm-before-fc", "--fc-norm",
               "--optimizer", "muon", "--muon-lr", "0.02", "--loss", "tv"]
    args = [*train_args(store, tiny_llama, out, *variant)]
    args[args.index("--max-steps") + 1] = "2"
    proc = peagle(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    train = [r for kind, _, r in losses(out) if kind == "train"]
    assert len(train) == 2 and all(0.0 <= r["loss"] <= 1.0 for r in train)  # TV lies in [0, 1]
    assert all(r["acceptance_length_estimate"] is None or r["acceptance_length_estimate"] >= 1.0 for r in train)

    proc = peagle("export", out, "--out", export)
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = load_export(export).draft.config
    assert (config.architecture, config.norm_before_residual, config.norm_before_fc, config.fc_norm) == (
        "qwen3", True, True, True)

    plain = ["--no-norm-before-fc" if a == "--norm-before-fc" else a for a in args]
    plain[plain.index("--max-steps") + 1] = "4"
    proc = peagle(*plain)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("peagle: error: ") and "norm" in lines[-1], proc.stderr
