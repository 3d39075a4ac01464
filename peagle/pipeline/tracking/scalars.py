"""What the trackers are sent: tags and values from ``metrics.jsonl`` records and eval reports (pure).

Every backend gets the same tags, grouped by their first path part:

* ``train/...``: every number of a training line of ``metrics.jsonl`` (``train/loss``, ``train/lr``,
  ``train/tokens_per_s``, ``train/data_wait_share``, ``train/bad_steps``, CUDA memory, ...), a list
  one tag per depth (``train/depth_agreement/depth_0``);
* ``held_out/...``: the same for an evaluation line (``--eval-store`` or the held-out split);
* ``acceptance_length/...``: the acceptance lengths side by side, each labelled with what it is:
  ``estimate_on_training_batches`` and ``estimate_on_held_out`` (the trainer's, from top-1
  agreement; the training one reads high, as the report's plot says), and ``measured_<mode>`` from
  `peagle eval` (offline chains, own loop, vLLM, a live server);
* ``measured/<mode>/...``: the rest of what `peagle eval` measured (per-depth acceptance, tokens per
  target forward, tokens/s with and without the draft, their ratio).

Only finite numbers are sent (a window whose every step was skipped has no loss: its ``None`` is left
out, as the plots leave it out).
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable

KIND_GROUPS = {"train": "train", "eval": "held_out"}
"""metrics.jsonl ``kind`` -> tag group."""
AL_ESTIMATES = {"train": "acceptance_length/estimate_on_training_batches",
                "eval": "acceptance_length/estimate_on_held_out"}
"""The trainer's acceptance-length estimate of each kind of line, named as an estimate."""
MEASURED_NAMES = {"offline": "offline_chains", "online": "own_loop", "vllm": "vllm", "server": "vllm_server"}
"""`peagle eval` report sections -> the name of their measured acceptance length."""
SPEED_NAMES = {"spec_tokens_per_second": "tokens_per_s_with_draft",
               "plain_tokens_per_second": "tokens_per_s_without_draft", "speedup": "speedup"}
NOT_SCALARS = frozenset({"kind", "step"})


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def record_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The tags of one ``metrics.jsonl`` record (module docstring); ``{}`` for a kind it does not know."""
    kind = record.get("kind", "train")
    group = KIND_GROUPS.get(kind)
    if group is None:
        return {}
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in NOT_SCALARS:
            continue
        if key == "acceptance_length_estimate":
            number = _number(value)
            if number is not None:
                out[AL_ESTIMATES[kind]] = number
        elif isinstance(value, (list, tuple)):
            for depth, item in enumerate(value):
                number = _number(item)
                if number is not None:
                    out[f"{group}/{key}/depth_{depth}"] = number
        else:
            number = _number(value)
            if number is not None:
                out[f"{group}/{key}"] = number
    return out


def report_scalars(report: dict[str, Any]) -> dict[str, float]:
    """The tags of a `peagle eval` report (``report.json``): what each mode measured."""
    out: dict[str, float] = {}
    for mode, name in MEASURED_NAMES.items():
        section = report.get(mode) or {}
        al = _number(section.get("acceptance_length"))
        if al is not None:
            out[f"acceptance_length/measured_{name}"] = al
        for depth, value in enumerate(section.get("per_depth_acceptance") or [], start=1):
            if _number(value) is not None:
                out[f"measured/{mode}/acceptance_depth_{depth}"] = float(value)
        forward = _number(section.get("tokens_per_target_forward"))
        if forward is not None:
            out[f"measured/{mode}/tokens_per_target_forward"] = forward
        speeds = section.get("speed") or {}
        for concurrency in [k for k in speeds if k.startswith("concurrency_")]:  # 1, --concurrency's, n
            for key, tag in SPEED_NAMES.items():
                number = _number((speeds.get(concurrency) or {}).get(key))
                if number is not None:
                    out[f"measured/{mode}/{tag}_{concurrency}"] = number
        if mode == "server":
            for key, tag in SPEED_NAMES.items():
                number = _number(section.get(key))
                if number is not None:
                    out[f"measured/{mode}/{tag}"] = number
    for key, value in (report.get("comparison") or {}).items():
        if key.endswith("_relative_difference") and _number(value) is not None:
            out[f"measured/{key}"] = float(value)
    return out


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """A config as hyperparameters every backend shows as such: nested keys joined by ``.``, lists
    comma-joined, ``None`` as ``none`` (TensorBoard's hparams and MLflow's params take no ``None``)."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_params(value, prefix=f"{name}."))
        elif isinstance(value, (list, tuple)):
            out[name] = ",".join(map(str, value))
        elif value is None:
            out[name] = "none"
        elif isinstance(value, (str, int, float, bool)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


def describe_stores(stores: Iterable[Any], weights: Iterable[float], manifest_hashes: Iterable[str]
                    ) -> list[dict[str, Any]]:
    """What a run trains on, once per store: path, weight, size and the settings it was extracted with
    (``stores``: opened ``peagle.pipeline.store.Store`` objects)."""
    return [{"path": str(store.root), "weight": weight, "manifest_hash": digest, "num_shards": len(store.shards),
             "num_samples": store.num_samples, "num_tokens": store.num_tokens, "settings": store.settings.to_dict()}
            for store, weight, digest in zip(stores, weights, manifest_hashes)]


def as_json_text(value: Any) -> str:
    """``value`` as indented JSON in a Markdown code block (TensorBoard's text tab renders Markdown)."""
    return "```json\n" + json.dumps(value, indent=2, sort_keys=True, default=str) + "\n```"
