"""What the target's full identity costs: sha256 of every byte of an 8B-sized target, once and cached.

    python benchmarks/target_hash.py --json benchmarks/results/cpu/target_hash.json
    python benchmarks/target_hash.py --dir /models/Llama-3.1-8B-Instruct      # a real target

A store records ``target.weights_sha256`` (``peagle/model/weights_hash.py``): every weight file's
sha256, each cached by path, size, mtime and ctime, so a change confined to tensors the sampled
``content_hash`` does not read is another target. This times, on ``--dir`` (default: a directory laid
out like Llama-3.1-8B's bf16 safetensors, four files of 4.98 + 5.00 + 4.92 + 1.17 GB = 16.07 GB,
made sparse in a temp dir and deleted after):

* ``sampled_s``: the sampled ``content_hash`` (16 windows of 64 KiB a file), what every run paid before;
* ``full_cold_s``: ``weights_sha256`` with an empty cache (the first extract or train on a machine),
  with the CPU seconds it took, ``full_cold_user_s`` (sha256) and ``full_cold_system_s`` (the kernel: page
  cache; for holes, zero-filled pages): on a shared machine the wall time is the load's;
* ``full_cached_s``: again, from the cache (every later run).

A sparse file's holes read as zeros without touching the disk, so on the default directory the cold
figure is the hashing alone; a real target adds its read at the disk's speed (``--dir`` measures
both, from the page cache or not, as the machine has it). JSON on stdout (and in ``--json``) with
the machine and its load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

LLAMA_8B_FILES = {"model-00001-of-00004.safetensors": 4_976_698_672, "model-00002-of-00004.safetensors": 4_999_802_720,
                  "model-00003-of-00004.safetensors": 4_915_916_176, "model-00004-of-00004.safetensors": 1_168_138_808}
"""Llama-3.1-8B-Instruct's weight files and their sizes in bytes, as the hub lists them."""


def sparse_target(root: Path) -> Path:
    """A directory with a config.json and Llama-3.1-8B's weight file names and sizes, all holes."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096}))
    for name, size in LLAMA_8B_FILES.items():
        with open(root / name, "wb") as f:
            f.truncate(size)
    return root


def timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def cpu_seconds() -> tuple[float, float]:
    """This process's (user, system) CPU time: on a shared machine, what the hashing itself costs (user:
    sha256; system: the page cache, which for a sparse file's holes is zero-filled pages)."""
    t = os.times()
    return t.user, t.system


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, help="a target directory (default: a sparse 8B-sized one, made and deleted)")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)

    from peagle.model.target import weights_hash as W
    from peagle.model.target.directory import CONFIG_FILE, content_hash, weight_files

    work = Path(tempfile.mkdtemp(prefix="peagle-target-hash-"))
    os.environ["PEAGLE_CACHE_DIR"] = str(work / "cache")  # an empty cache: the cold figure is a first run
    load_before = os.getloadavg()
    try:
        root = args.dir or sparse_target(work / "target")
        files = weight_files(root)
        num_bytes = sum(p.stat().st_size for p in files)
        sampled_s, _ = timed(lambda: content_hash(root))
        cpu_before = cpu_seconds()
        cold_s, digest = timed(lambda: W.weights_sha256(root, CONFIG_FILE, files))
        cold_user_s, cold_system_s = (after - before for after, before in zip(cpu_seconds(), cpu_before))
        cached_s, again = timed(lambda: W.weights_sha256(root, CONFIG_FILE, files))
        assert digest == again
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "benchmark": "target_hash", "command": " ".join(["benchmarks/target_hash.py", *(argv or sys.argv[1:])]),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_at_start": list(load_before), "load_average_at_end": list(os.getloadavg())},
        "target": str(args.dir) if args.dir else "sparse, Llama-3.1-8B's four weight files (holes: no disk reads)",
        "num_files": len(files), "num_bytes": num_bytes,
        "threads": min(4, len(files), os.cpu_count() or 1),  # weights_hash.files_sha256: files hashed at once
        "sampled_s": round(sampled_s, 4), "full_cold_s": round(cold_s, 2), "full_cached_s": round(cached_s, 4),
        "full_cold_gb_per_s": round(num_bytes / 1e9 / cold_s, 2),
        "full_cold_user_s": round(cold_user_s, 1),  # all threads
        "full_cold_system_s": round(cold_system_s, 1),
        "sha256_gb_per_user_s": round(num_bytes / 1e9 / cold_user_s, 2),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
