"""An export's ``peagle`` section as it travels: no host name, no absolute path, no credential.

An export's ``config.json`` is the file meant for a model hub, so what it says of the run that
trained it (``peagle/model/checkpoint_export.py`` composes that from the checkpoint) is made portable
here when :mod:`peagle.model.speculators_format` writes or copies an export, and read back here:
the checkpoint and the run's stores, target and directories become paths relative to the export
directory (:func:`recorded_path` turns them into paths on this machine again, so an export beside
its run still finds the run's metrics and held-out store); the training host keeps its software
facts only; the tracker settings are left out and any other credential redacted
(``peagle.schemas.secrets``). ``speculators_config.verifier.name_or_path`` is not part of this
section: vLLM loads the target from it, so it stays what ``--verifier-name`` (default: the target
path training used) says.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from peagle.model.speculators_config import PROVENANCE_KEY
from peagle.schemas.secrets import redact
from peagle.schemas.tracking_config import TRACKING_FIELDS
from peagle.schemas.train_config import parse_store_spec

PATH_BASE_KEY = "path_base"
"""Set to ``"export"`` in the ``peagle`` section when its paths are relative to the export directory
(every export written since they are; an older export's are as training recorded them)."""
RUN_PATH_FIELDS = ("target", "out", "eval_store", "init_from", "epoch_shards")
"""The run config's fields that hold one path (``store`` holds a list of ``STORE[:WEIGHT]``)."""
HOST_FACTS_KEPT = ("python", "torch", "cuda", "devices")
"""What of the training host an export says: the software and accelerators that explain a number,
not the machine's name or its platform string."""


def portable_provenance(provenance: dict[str, Any], out: str | os.PathLike, *,
                        base: str | os.PathLike | None = None) -> dict[str, Any]:
    """The ``peagle`` section as an export carries it (the file is meant for a model hub): host facts
    without the host name or platform (:data:`HOST_FACTS_KEPT`); the checkpoint and the run's paths
    relative to the export directory ``out`` (a relative one is taken relative to ``base``: the
    directory it was relative to, by default this process's working directory); the run config
    without its tracker settings (where a run logged is not the draft's business) and with any
    credential redacted (``peagle.schemas.secrets``)."""
    base_dir = Path(base) if base is not None else Path.cwd()
    here = Path(os.path.abspath(out))

    def rel(text: Any) -> Any:
        if not isinstance(text, str) or not text or "://" in text:
            return text
        return os.path.relpath(os.path.abspath(base_dir / text), here)

    def rel_spec(text: Any) -> Any:
        spec = parse_store_spec(text) if isinstance(text, str) else None
        if spec is None:
            return text
        return rel(spec.path) + (text[len(spec.path):] if text != spec.path else "")

    section = dict(provenance)
    host = section.get("host")
    if isinstance(host, dict):
        section["host"] = {k: host[k] for k in HOST_FACTS_KEPT if k in host}
    if "checkpoint" in section:
        section["checkpoint"] = rel(section["checkpoint"])
    run = section.get("run_config")
    if isinstance(run, dict):
        run = {k: v for k, v in run.items() if k not in TRACKING_FIELDS}
        for name in RUN_PATH_FIELDS:
            if name in run:
                run[name] = rel_spec(run[name]) if name == "eval_store" else rel(run[name])
        if isinstance(run.get("store"), list):
            run["store"] = [rel_spec(s) for s in run["store"]]
        section["run_config"] = run
    section[PATH_BASE_KEY] = "export"
    return redact(section)


def recorded_path(export_dir: str | os.PathLike, provenance: dict[str, Any], text: str) -> Path:
    """A path an export's ``peagle`` section records, as a path on this machine: relative to the export
    directory where the section says so (:data:`PATH_BASE_KEY`), else as recorded."""
    path = Path(text)
    if path.is_absolute() or provenance.get(PATH_BASE_KEY) != "export":
        return path
    return Path(os.path.normpath(Path(os.path.abspath(export_dir)) / path))


def moved_config(config_json: dict[str, Any], source: str | os.PathLike, out: str | os.PathLike) -> dict[str, Any]:
    """``config_json`` of the export ``source`` as a copy at ``out`` records it: its relative paths
    re-based onto ``out``."""
    provenance = config_json.get(PROVENANCE_KEY)
    if not isinstance(provenance, dict):
        return config_json
    base = Path(source) if provenance.get(PATH_BASE_KEY) == "export" else None
    return {**config_json, PROVENANCE_KEY: portable_provenance(provenance, out, base=base)}
