"""A run, a file or a server from elsewhere cannot steer peagle (docs/reliability.md, "What peagle
trusts"; issue 58), through the real CLI:

* a received run is data: `peagle eval RUN` whose ``trackers.json`` names another directory and a
  server writes only under ``--out`` and talks to no server its command line did not name;
* a pickle planted as a checkpoint part or a target's ``pytorch_model.bin`` is one line naming the
  file ("not a weights-only file"), never torch's advice to unpickle it anyway, and never runs;
* a "server" that answers a banner, JSON of another shape, a body cut short, a body too large, or
  drips its headers is one line each (servers on 127.0.0.1, started here, that stop themselves);
* a ``--config`` file holding what a parser takes silently (a key twice, one flag spelled two ways,
  ``true`` or ``2.5`` for an integer) is one line naming the file and the key, and nothing is written;
* a worker that waits on a lock another process holds says, after a few seconds, who holds it.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from faultkit import ok, one_line_error, parallel_map, snapshot
from peagle.pipeline.checkpoint_files import latest_valid_checkpoint

AREA = "hostile input"


class _Recorder(http.server.BaseHTTPRequestHandler):
    timeout = 10

    def _answer(self) -> None:
        self.server.seen.append(self.requestline)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


def recording_server() -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.daemon_threads, server.seen = True, []
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    return server


def test_a_received_run_is_shown_not_obeyed(train_baseline, runner, tmp_path, figures):
    """`peagle eval RUN` of a run whose trackers.json names a log directory elsewhere and a tracking
    server: without --logger it logs nowhere, contacts nothing, writes only under --out and leaves the
    run as it was, saying what the run recorded; with --logger tensorboard the events go to OUT/logs."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    shutil.copytree(train_baseline.run, run)
    server = recording_server()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    (run / "trackers.json").write_text(json.dumps({
        "version": 1, "plan": {"loggers": ["tensorboard", "mlflow"], "run_name": "run", "project": "peagle",
                               "log_dir": str(elsewhere / "logs"), "mlflow_uri": url, "notes": []},
        "backends": {"tensorboard": {"log_dir": str(elsewhere / "logs" / "tensorboard")},
                     "mlflow": {"run_id": "0" * 32, "tracking_uri": url}}}))
    before = snapshot(run)
    common = ["--target", train_baseline.target, "--mode", "offline", "--max-samples", "4", "--quiet"]
    try:
        plain = runner.run("eval", run, *common, "--out", tmp_path / "a", env={"MLFLOW_TRACKING_URI": None})
        logged = runner.run("eval", run, *common, "--out", tmp_path / "b", "--logger", "tensorboard",
                            env={"MLFLOW_TRACKING_URI": None})
    finally:
        server.shutdown()
        server.server_close()
    figures.add(trials=2, bad_inputs_tried=2)
    ok(plain)
    ok(logged)
    assert "shown, not followed" in plain.stderr and url in plain.stderr, plain.describe()
    assert server.seen == [] and not elsewhere.exists()
    assert snapshot(run) == before  # nothing written in the run: no trackers.json, no events, no eval/
    assert not (tmp_path / "a" / "trackers.json").exists() and not (tmp_path / "a" / "logs").exists()
    assert list((tmp_path / "b" / "logs" / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((tmp_path / "b" / "trackers.json").read_text())["plan"]["loggers"] == ["tensorboard"]
    figures.add(bad_inputs_handled=2)


class _Payload:
    """A pickle that would run ``os.system`` when unpickled without weights-only."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_pickle(file: Path, marker: Path) -> None:
    torch.save({"weight": _Payload(marker)}, file)


def _reseal(checkpoint: Path, name: str) -> None:
    """Make ``metadata.json`` vouch for the planted part (size and sha256), as a forger would."""
    meta = json.loads((checkpoint / "metadata.json").read_text())
    data = (checkpoint / name).read_bytes()
    meta["files"][name] = {**meta["files"][name], "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "metadata.json").write_text(json.dumps(meta))


def test_a_planted_pickle_is_one_line_naming_the_file(train_baseline, runner, tmp_path, figures):
    """A checkpoint part (its metadata re-sealed) and a target's pytorch_model.bin that pickle code:
    export, eval and a resumed train of the run, and extract with the target, each exit 2 in one line
    naming the file and saying it is not a weights-only file; torch's advice to re-run with
    weights_only=False is never shown; the code never runs."""
    from faultkit import EXTRACT_FLAGS
    from peagle.testing.chat_data import write_chat_jsonl

    marker = tmp_path / "code-ran"
    run = tmp_path / "run"
    shutil.copytree(train_baseline.run, run)
    newest = latest_valid_checkpoint(run)
    plant_pickle(newest / "model.pt", marker)
    _reseal(newest, "model.pt")
    target = tmp_path / "target"
    shutil.copytree(train_baseline.target, target)
    for weights in target.glob("*.safetensors"):
        weights.unlink()
    plant_pickle(target / "pytorch_model.bin", marker)
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 4, seed=3)
    resume = train_baseline.args(run)
    resume[resume.index("--max-steps") + 1] = "12"
    cases = [
        (("export", run, "--out", tmp_path / "export"), newest / "model.pt"),
        (("eval", run, "--target", train_baseline.target, "--mode", "offline", "--out", tmp_path / "report"),
         newest / "model.pt"),
        (tuple(resume), newest / "model.pt"),
        (("extract", "--data", data, "--target", target, "--out", tmp_path / "store", *EXTRACT_FLAGS),
         target / "pytorch_model.bin"),
    ]
    results = parallel_map(lambda case: runner.run(*case[0]), cases)
    figures.add(trials=len(cases), bad_inputs_tried=len(cases))
    for (args, file), result in zip(cases, results):
        one_line_error(result, f"{file.name} is not a weights-only file", "peagle never unpickles code")
        assert str(file.parent.name) in result.stderr, result.describe()
        assert "weights_only" not in result.stderr, result.describe()
        figures.add(bad_inputs_handled=1)
    assert not marker.exists()
    assert not (tmp_path / "export").exists() and not (tmp_path / "report" / "report.json").exists()


# ---------------------------------------------------------------------------------------------------
# Hostile servers: each answers every connection its own wrong way, for at most LIFETIME_S


LIFETIME_S = 30.0


def _http_head(length: int) -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode()


def _banner(conn: socket.socket) -> None:
    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")


def _other_shape(conn: socket.socket) -> None:
    body = b'["not", "a", "model", "list"]'
    conn.sendall(_http_head(len(body)) + body)


def _cut_short(conn: socket.socket) -> None:
    conn.sendall(_http_head(4000) + b'{"data": [{"id": "x", "ro')


def _too_large(conn: socket.socket) -> None:
    conn.sendall(_http_head(10 ** 12) + b"{" * 65536)


def _endless(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n[")
    chunk = b"1," * 32768
    for _ in range(80 * 2 ** 20 // len(chunk)):  # 80 MiB, no length: only a cap on what is read stops it
        conn.sendall(chunk)


def _drip(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    ends = time.monotonic() + LIFETIME_S
    while time.monotonic() < ends:
        conn.sendall(b"X")  # one header byte at a time: every read is quick, the answer never ends
        time.sleep(0.2)


class HostileServer:
    """A TCP server on 127.0.0.1 that answers with ``behave(conn)`` after reading the request, then
    closes; it stops itself after :data:`LIFETIME_S` whatever happens."""

    def __init__(self, behave):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.behave, self.connections = behave, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        ends = time.monotonic() + LIFETIME_S
        while not self.stop.is_set() and time.monotonic() < ends:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()
        self.sock.close()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                conn.recv(65536)  # the request (its first packet is enough)
                self.behave(conn)
            except OSError:  # the client gave up: what it should do
                pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


SERVERS = [  # (name, behaviour, what the one line says)
    ("banner", _banner, "did not answer in HTTP"),
    ("other-shape", _other_shape, "answered JSON of another shape"),
    ("cut-short", _cut_short, "answered a body cut short"),
    ("too-large", _too_large, "answered 1,000,000,000,000 bytes, more than the"),
    ("endless", _endless, "answered more than the"),
    ("dripped-headers", _drip, "did not answer within 2 s"),
]


@pytest.fixture(scope="module")
def export_dir(train_baseline, runner, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile-export") / "export"
    ok(runner.run("export", train_baseline.run, "--out", out))
    return out


def test_a_hostile_server_is_one_line_each(export_dir, train_baseline, runner, tmp_path, figures):
    """`peagle eval EXPORT --server URL` against a banner, JSON of another shape, a body cut short, a
    body of 1 TB declared, one of 80 MiB without a length, and headers dripped a byte at a time: exit 2,
    one line each naming the URL, within the whole-request deadline (--server-timeout 2), no report."""
    servers = [(name, HostileServer(behave), needle) for name, behave, needle in SERVERS]
    try:
        def measure(case):
            name, server, _ = case
            started = time.monotonic()
            result = runner.run("eval", export_dir, "--server", server.url, "--mode", "server", "--target",
                                train_baseline.target, "--server-timeout", "2", "--quiet", "--out", tmp_path / name,
                                timeout=120)
            return result, time.monotonic() - started

        results = parallel_map(measure, servers)
    finally:
        for _, server, _ in servers:
            server.close()
    figures.add(trials=len(servers), bad_inputs_tried=len(servers))
    for (name, server, needle), (result, seconds) in zip(servers, results):
        one_line_error(result, server.url, needle)
        assert server.connections >= 1 and seconds < 60, (name, seconds)
        assert not (tmp_path / name / "report.json").exists()
        figures.add(bad_inputs_handled=1)


# ---------------------------------------------------------------------------------------------------
# Config files

CONFIGS = [  # (file name, text, what the one line says besides the file)
    ("twice.yaml", "speculative_tokens: 2\nspeculative_tokens: 3\n", "key 'speculative_tokens' is given twice"),
    ("twice.toml", "dtype = 'float32'\ndtype = 'bfloat16'\n", "key 'dtype' is given twice"),
    ("spelled.toml", "speculative-tokens = 2\nspeculative_tokens = 3\n",
     "'speculative-tokens' and 'speculative_tokens' are one flag spelled two ways"),
    ("spelled.yaml", "verifier-name: a/b\nverifier_name: c/d\n", "are one flag spelled two ways"),
    ("bool.yaml", "speculative_tokens: true\n", "key 'speculative-tokens' takes an integer, got True"),
    ("bool.toml", "speculative_tokens = true\n", "key 'speculative-tokens' takes an integer, got True"),
    ("fraction.yaml", "speculative_tokens: 2.5\n", "key 'speculative-tokens' takes an integer, got 2.5"),
]


def test_a_config_file_a_parser_would_take_silently_is_refused(train_baseline, runner, tmp_path, figures):
    """`peagle export --config FILE` with a key given twice (YAML, TOML), one flag spelled `a-b` and
    `a_b`, `true` or `2.5` for an integer: exit 2, one line naming the file and the key, no export."""
    def export(case):
        name, text, _ = case
        (tmp_path / name).write_text(text)
        return runner.run("export", train_baseline.run, "--out", tmp_path / f"out-{name}", "--config",
                          tmp_path / name)

    results = parallel_map(export, CONFIGS)
    figures.add(trials=len(CONFIGS), bad_inputs_tried=len(CONFIGS))
    for (name, _, needle), result in zip(CONFIGS, results):
        one_line_error(result, f"config file {tmp_path / name}", needle)
        assert not (tmp_path / f"out-{name}").exists(), name
        figures.add(bad_inputs_handled=1)


# ---------------------------------------------------------------------------------------------------
# A held lock

SAYS_WITHIN_S = 30.0
"""How soon the waiting line must come (peagle.pipeline.atomic.LOCK_NOTE_S is 5 s; the rest is startup)."""
HOLD = """
import sys, time
from peagle.pipeline.atomic import file_lock
with file_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_worker_waiting_on_a_held_lock_says_who_holds_it(extract_baseline, runner, tmp_path, figures):
    """A store's lock held by another process (as a suspended worker holds it): `peagle extract` says
    within a few seconds whom it waits for (pid, host, since when) and goes on waiting; once the holder
    is gone it finishes."""
    store = tmp_path / "store"
    shutil.copytree(extract_baseline.store, store)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(store / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        job = runner.start(*extract_baseline.args(store))
        deadline = time.monotonic() + SAYS_WITHIN_S
        said = ""
        while "waiting" not in said and time.monotonic() < deadline:
            assert job.running, job.wait(5).describe()
            time.sleep(0.2)
            said = job.stderr.read_text(errors="replace") if job.stderr.exists() else ""
        figures.add(trials=1, faults_injected=1)
        assert job.running, said
        line = next((ln for ln in said.splitlines() if "waiting" in ln), None)
        assert line is not None, said
        assert f"held by pid {holder.pid} on {socket.gethostname()} since " in line and "still waiting" in line
    finally:
        holder.kill()
        holder.wait(30)
    ok(job.wait(120))
    figures.add(faults_survived=1)
