"""A damaged export is one line wherever it is read (docs/reliability.md, "Nothing half-made is
trusted"; issue 46).

An export's ``config.json`` is read by `peagle eval` (and the demo, which runs it), `peagle train
--init-from` and the restore of an export written without its embedding. Each damage below used to
end in a traceback (``KeyError: 'hidden_size'``), in a line that named something else ("is neither a
checkpoint nor a run directory"), or in a report measured with a value out of range (``K = 0``).
Through the real CLI each must now be exit 2 and one line naming the file and the field, before any
model is loaded and without a report.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

from faultkit import ok, one_line_error, snapshot

AREA = "damaged exports"


def _without(key: str) -> Callable[[dict], Any]:
    def edit(config: dict) -> dict:
        del config[key]
        return config
    return edit


def _layer(**values: Any) -> Callable[[dict], Any]:
    def edit(config: dict) -> dict:
        config["transformer_layer_config"].update(values)
        return config
    return edit


def _k(value: Any) -> Callable[[dict], Any]:
    def edit(config: dict) -> dict:
        config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = value
        return config
    return edit


def _top(**values: Any) -> Callable[[dict], Any]:
    def edit(config: dict) -> dict:
        config.update(values)
        return config
    return edit


# (name, change to config.json, what the one line must say besides the file)
DAMAGES: list[tuple[str, Callable[[dict], Any], str]] = [
    ("no-layer-config", _without("transformer_layer_config"), "transformer_layer_config is missing"),
    ("no-hidden-size", _layer(hidden_size=None), "transformer_layer_config.hidden_size is missing"),
    ("text-hidden-size", _layer(hidden_size="128"), "transformer_layer_config.hidden_size is '128'"),
    ("zero-heads", _layer(num_attention_heads=0), "transformer_layer_config.num_attention_heads is 0"),
    ("k-zero", _k(0), "speculative_tokens is 0"),
    ("k-negative", _k(-2), "speculative_tokens is -2"),
    ("no-proposal", _top(speculators_config={}), "speculators_config.proposal_methods is missing"),
    ("mask-outside-vocab", _top(mask_token_id=10 ** 6), "mask_token_id is 1000000"),
    ("aux-ids-text", _top(eagle_aux_hidden_state_layer_ids="2,4,6"), "eagle_aux_hidden_state_layer_ids"),
    ("a-list", lambda config: [config], "not an object"),
]


def damaged_copy(export: Path, out: Path, change: Callable[[dict], Any] | None = None, *,
                 cut: bool = False) -> Path:
    shutil.copytree(export, out)
    text = (out / "config.json").read_text()
    if cut:
        (out / "config.json").write_text(text[: len(text) // 2])
    else:
        (out / "config.json").write_text(json.dumps(change(json.loads(text)), indent=1))
    return out


def test_eval_of_a_damaged_export_is_one_line_naming_the_file_and_field(train_baseline, runner, tmp_path, figures):
    """`peagle eval` of an export whose config.json lacks a section or a size, holds a value out of range
    (K = 0, a mask token outside the vocab) or is cut short: exit 2, one line naming config.json and the
    field (or where it ends), no report; `peagle train --init-from` the same exports is refused so too,
    before any step; sizes that disagree with the tensors are named with the tensor; `peagle export` of a
    damaged export, or of a damaged one written without its embedding, is the same line; `peagle export`
    again replaces a damaged export whole."""
    export = tmp_path / "export"
    ok(runner.run("export", train_baseline.final, "--out", export))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hi.\n")
    cases = [(name, damaged_copy(export, tmp_path / name, change), needle) for name, change, needle in DAMAGES]
    cases.append(("cut-short", damaged_copy(export, tmp_path / "cut-short", cut=True), "cut short"))
    for name, damaged, needle in cases:
        figures.add(trials=1, faults_injected=1)
        report = tmp_path / f"report-{name}"
        one_line_error(runner.run("eval", damaged, "--target", train_baseline.target, "--mode", "online",
                                  "--prompts", prompts, "--max-new-tokens", "4", "--out", report, "--quiet"),
                       str(damaged / "config.json"), needle)
        assert not report.exists(), name
        figures.add(faults_survived=1)
    for name, damaged, needle in (cases[0], cases[4], cases[-1]):
        figures.add(trials=1, faults_injected=1)
        run = tmp_path / f"warm-{name}"
        one_line_error(runner.run(*train_baseline.args(run, "--init-from", str(damaged))),
                       str(damaged / "config.json"), needle)
        assert not (run / "metrics.jsonl").exists(), name
        figures.add(faults_survived=1)

    # a size that disagrees with the tensors: the file, the tensor and both shapes
    figures.add(trials=1, faults_injected=1)
    config = json.loads((export / "config.json").read_text())
    wider = config["transformer_layer_config"]["intermediate_size"] * 2
    damaged = damaged_copy(export, tmp_path / "wider", _layer(intermediate_size=wider))
    provenance = json.loads((damaged / "config.json").read_text())
    provenance["peagle"]["draft_config"]["intermediate_size"] = wider
    (damaged / "config.json").write_text(json.dumps(provenance))
    one_line_error(runner.run("eval", damaged, "--target", train_baseline.target, "--mode", "online", "--prompts",
                              prompts, "--max-new-tokens", "4", "--out", tmp_path / "report-wider", "--quiet"),
                   str(damaged / "model.safetensors"), "mlp.", "has shape", "the draft config needs")
    # and the speculators fields against the peagle section, naming the field
    damaged = damaged_copy(export, tmp_path / "disagree", _layer(intermediate_size=wider))
    one_line_error(runner.run("eval", damaged, "--target", train_baseline.target, "--mode", "online", "--prompts",
                              prompts, "--max-new-tokens", "4", "--out", tmp_path / "report-disagree", "--quiet"),
                   str(damaged / "config.json"), "intermediate_size")
    assert not (tmp_path / "report-wider").exists() and not (tmp_path / "report-disagree").exists()
    figures.add(faults_survived=1)
    # `peagle export` of a damaged export (to write the copy that travels), and of a damaged copy that
    # travelled without its embedding (to make it whole): the same line
    from peagle.model.speculators_format import without_target_embedding

    one_line_error(runner.run("export", cases[-1][1], "--without-target-embedding", "--out", tmp_path / "travel-0"),
                   str(cases[-1][1] / "config.json"), "cut short")
    stripped = without_target_embedding(export, tmp_path / "stripped")
    (stripped / "config.json").write_text((cases[4][1] / "config.json").read_text())
    one_line_error(runner.run("export", stripped, "--target", train_baseline.target, "--out", tmp_path / "whole"),
                   str(stripped / "config.json"), cases[4][2])
    assert not (tmp_path / "travel-0").exists() and not (tmp_path / "whole").exists()
    # exporting again over a damaged export replaces it whole
    ok(runner.run("export", train_baseline.final, "--out", tmp_path / "cut-short"))
    assert snapshot(tmp_path / "cut-short") == snapshot(export)
