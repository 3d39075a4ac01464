"""Build docker/*.Dockerfile and run them, and record what was seen in docker/images-checked.json.

    sudo python3 scripts/check_images.py [--work DIR]      # ~20-60 minutes on 2 cores (the demo is most of it)
    python3 scripts/check_images.py digest                 # the inputs' digest the record must carry

Run it whenever a change touches docker/, locks/base.txt or pyproject.toml's [project]/[build-system],
and commit the JSON it writes: tests/test_docker.py fails while the record was made for other inputs.
Too slow for CI (it installs the whole lock into each image), so CI checks that the record is current.

What it does, all on this machine, with no container registry:
* starts its own dockerd (Debian's docker.io, installed when missing; data under --work, stopped by pid
  at the end; no bridge, no iptables rules) unless --docker-host names a running one;
* downloads the lock's wheels (`pip download --no-deps -r locks/base.txt`, the configured index) into
  --work/wheelhouse and serves them on 127.0.0.1 to the builds (FIND_LINKS: no index in the images);
* makes a stand-in base: a Debian bookworm root filesystem with its Python 3.11 (mmdebstrap, installed
  when missing), `docker import`ed; and the GPU stand-ins on it: the lock's CPU torch (the PyTorch
  image's part) and torch + transformers (the vLLM image's part, without vLLM);
* builds the three images on them (BASE, BUILD_BASE, FIND_LINKS build arguments);
* runs `peagle demo --target tiny` in the CPU image as its non-root user, without a network, with the
  demo's directory and cache on a host directory mounted as a volume, then a second container checks
  the store left there (`peagle store verify`); runs `peagle --help` and `--version` in the GPU images.
Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docker" / "images-checked.json"
LOCK = ROOT / "locks" / "base.txt"
STANDIN = "peagle-standin/python:3.11-bookworm"
STANDIN_TORCH = "peagle-standin/torch:lock"
STANDIN_VLLM = "peagle-standin/torch-transformers:lock"
DEMO = ["demo", "--target", "tiny", "--out", "/out/demo", "--cache-dir", "/out/cache"]


def inputs_digest() -> dict[str, str]:
    """sha256 of what decides the images' contents: the Dockerfiles and their helper, the lock, and the
    tables of pyproject.toml that build and install peagle (not its tool settings)."""
    files = sorted((ROOT / "docker").glob("*.Dockerfile")) + [ROOT / "docker" / "constraints.py", LOCK]
    digests = {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    tables = json.dumps({k: pyproject[k] for k in ("build-system", "project")}, sort_keys=True)
    digests["pyproject.toml [build-system] [project]"] = hashlib.sha256(tables.encode()).hexdigest()
    digests["all"] = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()
    return digests


def lock_pin(name: str) -> str:
    """The lock's ``name==version`` line."""
    return next(line for line in LOCK.read_text().splitlines() if line.startswith(f"{name}=="))


def sh(*cmd: str, log: Path, env: dict | None = None, timeout: float = 3600, stdin: str | None = None) -> float:
    """Run ``cmd``, its output appended to ``log``; seconds taken. Raises on a non-zero exit."""
    started = time.monotonic()
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                              input=stdin, text=True)
    if proc.returncode:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}; {log}:\n{tail}")
    return round(time.monotonic() - started, 1)


def ensure_packages(log: Path) -> None:
    wanted = [pkg for cmd, pkg in (("dockerd", "docker.io"), ("mmdebstrap", "mmdebstrap")) if not shutil.which(cmd)]
    if wanted:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        sh("apt-get", "update", "-qq", log=log, env=env)
        sh("apt-get", "install", "-y", "-qq", *wanted, log=log, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RUN_DIR = Path("/tmp") / f"peagle-dockerd-{os.getpid()}"
"""The daemon's socket, pid file and exec root (short: a unix socket path has ~100 bytes)."""


def start_dockerd(work: Path) -> tuple[subprocess.Popen, str]:
    RUN_DIR.mkdir()
    sock = f"unix://{RUN_DIR}/docker.sock"
    log = work / "dockerd.log"
    proc = subprocess.Popen(["dockerd", "--data-root", str(work / "docker-root"), "--exec-root", str(RUN_DIR / "exec"),
                             "--pidfile", str(RUN_DIR / "dockerd.pid"), "-H", sock, "--bridge=none", "--iptables=false",
                             "--ip-masq=false"], stdout=log.open("w"), stderr=subprocess.STDOUT)
    for _ in range(300):
        if subprocess.run(["docker", "-H", sock, "info"], capture_output=True).returncode == 0:
            return proc, sock
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    stop_dockerd(proc)
    raise RuntimeError(f"dockerd did not start; see {log}")


def stop_dockerd(proc: subprocess.Popen) -> None:
    """Stop it (its containerd with it) and leave nothing behind: the network namespace it mounted too."""
    proc.terminate()
    proc.wait(timeout=120)
    with open("/proc/mounts") as mounts:
        inside = [line.split()[1] for line in mounts if line.split()[1].startswith(f"{RUN_DIR}/")]
    for path in sorted(inside, reverse=True):
        subprocess.run(["umount", path], check=False)
    shutil.rmtree(RUN_DIR, ignore_errors=True)


def image_size_mb(docker: list[str], image: str) -> int:
    out = subprocess.run([*docker, "image", "inspect", "-f", "{{.Size}}", image], capture_output=True, text=True)
    return int(out.stdout.strip()) // 2**20


def output(docker: list[str], *args: str) -> tuple[int, str]:
    proc = subprocess.run([*docker, *args], capture_output=True, text=True, timeout=600)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def check(work: Path, docker: list[str], log: Path, record: dict) -> None:
    wheels = work / "wheelhouse"
    record["steps"]["wheelhouse_s"] = sh(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-r", str(LOCK),
                                         "-d", str(wheels), log=log)
    record["wheelhouse"] = f"{len(list(wheels.glob('*.whl')))} wheels, pip download --no-deps -r locks/base.txt"
    rootfs = work / "bookworm-python3.tar"
    if not rootfs.exists():
        tmp = rootfs.with_suffix(".tmp.tar")
        record["steps"]["rootfs_s"] = sh("mmdebstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                                         "bookworm", str(tmp), log=log)
        tmp.rename(rootfs)
    record["steps"]["import_s"] = sh(*docker, "import", "--change", 'CMD ["python3"]', str(rootfs), STANDIN, log=log)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port), "--directory",
                               str(wheels)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        links = f"http://127.0.0.1:{port}/"
        time.sleep(1)
        for name, pins in ((STANDIN_TORCH, [lock_pin("torch")]), (STANDIN_VLLM, [lock_pin("torch"), lock_pin("transformers")])):
            dockerfile = (f"FROM {STANDIN}\nRUN python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir "
                          f"--no-index --find-links {links} {' '.join(pins)}\nENV PATH=/opt/venv/bin:$PATH\n")
            record["steps"][f"standin {name}_s"] = sh(*docker, "build", "--network", "host", "-t", name, "-", log=log,
                                                      stdin=dockerfile)
        for image, base in (("cpu", STANDIN), ("extract", STANDIN_VLLM), ("train", STANDIN_TORCH)):
            tag = f"peagle-{image}:0.1.0"
            seconds = sh(*docker, "build", "--network", "host", "-f", f"docker/{image}.Dockerfile", "-t", tag,
                         "--build-arg", f"BASE={base}", "--build-arg", f"BUILD_BASE={STANDIN}",
                         "--build-arg", f"FIND_LINKS={links}", ".", log=log)
            record["images"][image] = {"base": base, "built": True, "build_s": seconds,
                                       "size_mb": image_size_mb(docker, tag)}
    finally:
        server.terminate()
        server.wait()
    run_cpu_demo(work, docker, log, record["images"]["cpu"])
    for image, prefix in (("extract", []), ("train", ["peagle"])):
        tag = f"peagle-{image}:0.1.0"
        rc, text = output(docker, "run", "--rm", "--network", "none", tag, *prefix, "--help")
        entry = record["images"][image]
        entry["help_rc"], entry["help_commands"] = rc, sorted(set(re.findall(r"^\s{2}(\w+)\s{2,}", text, re.M)))
        entry["version_rc"], entry["version"] = output(docker, "run", "--rm", "--network", "none", tag, *prefix, "--version")
        entry["user"] = output(docker, "run", "--rm", "--entrypoint", "id", tag, "-u")[1]
        entry["ran"] = "peagle --help, peagle --version"


def run_cpu_demo(work: Path, docker: list[str], log: Path, entry: dict) -> None:
    volume = work / "demo-volume"
    shutil.rmtree(volume, ignore_errors=True)
    volume.mkdir()
    os.chown(volume, 10001, 10001)  # the image's user
    tag = "peagle-cpu:0.1.0"
    entry["user"] = output(docker, "run", "--rm", "--entrypoint", "id", tag, "-u")[1]
    # OMP_WAIT_POLICY=PASSIVE: as scripts/test.sh, for cores shared with other work (spinning threads starve)
    seconds = sh(*docker, "run", "--rm", "--network", "none", "-e", "OMP_WAIT_POLICY=PASSIVE", "-v", f"{volume}:/out",
                 tag, *DEMO, log=log, timeout=4 * 3600)
    said = log.read_text().split(f"$ {' '.join(docker)} run")[-1].splitlines()  # this run's output
    summary = [line.strip() for line in said if re.match(r"(offline|online|time) {3,}", line)]
    rc, verify = output(docker, "run", "--rm", "--network", "none", "-v", f"{volume}:/out", tag, "store", "verify",
                        "--store", "/out/demo/store")
    entry.update(ran=f"docker run --rm --network none -e OMP_WAIT_POLICY=PASSIVE -v VOLUME:/out peagle-cpu:0.1.0 {' '.join(DEMO)}",
                 demo_rc=0, demo_s=seconds, demo_summary=summary,
                 left_on_volume=sorted(p.name for p in (volume / "demo").iterdir()),
                 store_verify_rc=rc, store_verify=verify.splitlines()[-1] if verify else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", choices=["check", "digest"], default="check")
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("PEAGLE_IMAGES_WORK", "/tmp/peagle-images")),
                        help="wheelhouse, root filesystem, docker data, logs, the demo's volume (never in git)")
    parser.add_argument("--docker-host", help="use this running daemon (DOCKER_HOST form) instead of starting one")
    args = parser.parse_args()
    if args.what == "digest":
        print(json.dumps(inputs_digest(), indent=1))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "check_images.log"
    log.write_text("")
    os.chdir(ROOT)
    started = time.monotonic()
    record = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "inputs": inputs_digest(),
              "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "machine": f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}",
              "steps": {}, "images": {}, "result": "failed"}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stop still stops the daemon and writes the record
    ensure_packages(log)
    dockerd = None
    host = args.docker_host
    if not host:
        dockerd, host = start_dockerd(args.work)
    docker = ["docker", "-H", host]
    try:
        record["engine"] = output(docker, "version", "-f", "server {{.Server.Version}}, client {{.Client.Version}}")[1]
        check(args.work, docker, log, record)
        ok = all(e.get("built") for e in record["images"].values()) and record["images"]["cpu"].get("store_verify_rc") == 0 \
            and all(record["images"][i].get("help_rc") == 0 for i in ("extract", "train"))
        record["result"] = "passed" if ok else "failed"
    except Exception as exc:  # recorded (and said below): a failed check is a result too
        record["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if dockerd is not None:
            stop_dockerd(dockerd)
        record["total_s"] = round(time.monotonic() - started)
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print(f"check_images: {record['result']} in {record['total_s']} s; wrote {RECORD.relative_to(ROOT)} (log: {log})")
    sys.exit(0 if record["result"] == "passed" else 1)


if __name__ == "__main__":
    main()
