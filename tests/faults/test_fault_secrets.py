"""Secrets stay in the process (docs/reliability.md, "What peagle trusts"; issue 58).

A team's ``--config`` file names an MLflow store with a password in its URI, the environment holds
a token, and eval is given another tracking URI with a password on its command line: the real CLI
trains, exports and evaluates with them (a real MLflow file store at each URI,
``file://USER:PASS@localhost/PATH``, TensorBoard, and W&B offline, which records a process's argv),
and no byte of any file those commands write, nor their stdout or stderr, holds a secret; what the
trackers show is the redacted URI, and the stores were used. A tracking server's URI with
``user:pass@`` reaches a server on 127.0.0.1 (started here) as a Basic ``Authorization`` header, on
the pre-flight request and on MLflow's own, never in a request line; its refusal is one line
without the password.
"""

from __future__ import annotations

import base64
import http.server
import json
import threading
import uuid
from pathlib import Path

import pytest

from faultkit import TRAIN_FLAGS, ok, one_line_error

pytest.importorskip("tensorboard", reason="the tracker extras are not installed (scripts/install_loggers.sh)")
pytest.importorskip("mlflow", reason="the tracker extras are not installed (scripts/install_loggers.sh)")
pytest.importorskip("wandb", reason="the tracker extras are not installed (scripts/install_loggers.sh)")

AREA = "secrets"
STEPS = 2


def train_flags() -> list[str]:
    flags = list(TRAIN_FLAGS)
    flags[flags.index("--max-steps") + 1] = str(STEPS)
    flags[flags.index("--save-every") + 1] = str(STEPS)
    return flags


def no_tracker_env(tmp: Path, **more: str | None) -> dict[str, str | None]:
    """No W&B login, no tracking URI but what the test sets."""
    return {"NETRC": str(tmp / "no-netrc"), "WANDB_API_KEY": None, "MLFLOW_TRACKING_URI": None, **more}


def files_holding(root: Path, secrets: list[str]) -> list[str]:
    """Every file under ``root`` (recursively, as bytes) that holds one of ``secrets``."""
    needles = [s.encode() for s in secrets]
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and not p.is_symlink() and any(n in p.read_bytes() for n in needles))


def test_a_planted_secret_is_in_no_file_and_no_line(train_baseline, runner, tmp_path, figures, monkeypatch):
    """A password in a --config file's tracking URI, a token in the environment and a tracking URI with a
    password on eval's command line (also logged to W&B offline): train, export and eval (and a failing train) write none of them anywhere, nor print
    them; the trackers hold the redacted URI and the MLflow stores at those URIs hold the runs."""
    from mlflow import MlflowClient

    password, token, env_password = (f"{name}-{uuid.uuid4().hex}" for name in ("pw", "tok", "envpw"))
    work = tmp_path / "work"  # everything the commands write; the config files the team wrote sit beside it
    team = tmp_path / "team.yaml"
    store_uri = f"file://alice:{password}@localhost{work / 'mlruns'}"
    team.write_text(f"logger: tensorboard,mlflow\nmlflow_tracking_uri: {store_uri}\n")
    run, export, report = work / "run", work / "export", work / "report"
    env = no_tracker_env(tmp_path, HF_TOKEN=token)
    results = [ok(runner.run("train", "--store", train_baseline.store, "--target", train_baseline.target, "--out", run,
                             *train_flags(), "--config", team, env=env))]
    results.append(ok(runner.run("export", run, "--out", export, env=env)))
    # eval: the URI with a password on the command line (W&B records a process's argv unless told not to)
    argv_uri = f"file://bob:{env_password}@localhost{work / 'env-mlruns'}"
    results.append(ok(runner.run("eval", run, "--target", train_baseline.target, "--mode", "offline", "--max-samples",
                                 "4", "--quiet", "--out", report, "--logger", "tensorboard,mlflow,wandb",
                                 "--wandb-mode", "offline", "--mlflow-tracking-uri", argv_uri, env=env)))
    refused = tmp_path / "refused.yaml"
    refused.write_text(f"logger: mlflow\nmlflow_tracking_uri: http://alice:{password}@127.0.0.1:9/\n")
    failed = runner.run("train", "--store", train_baseline.store, "--target", train_baseline.target, "--out",
                        work / "refused", *train_flags(), "--config", refused, env=env)
    one_line_error(failed, "--logger mlflow: cannot reach http://127.0.0.1:9/health")
    results.append(failed)
    figures.add(trials=4, bad_inputs_tried=3)

    secrets = [password, token, env_password]
    assert files_holding(work, secrets) == []
    for result in results:
        assert not [s for s in secrets if s in result.stdout + result.stderr], result.describe()
    figures.add(bad_inputs_handled=3)

    # the secrets were used, not dropped: the stores at those URIs hold the runs, and say where they are
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when asked
    shown = f"file://alice:***@localhost{work / 'mlruns'}"
    trained = MlflowClient(tracking_uri=f"file://localhost{work / 'mlruns'}")
    runs = trained.search_runs([trained.get_experiment_by_name("peagle").experiment_id])
    assert len(runs) == 1 and runs[0].data.params["mlflow_tracking_uri"] == shown
    assert "train/loss" in runs[0].data.metrics
    assert json.loads((run / "run.json").read_text())["train_config"]["mlflow_tracking_uri"] == shown
    assert json.loads((run / "trackers.json").read_text())["backends"]["mlflow"]["tracking_uri"] == shown
    measured = MlflowClient(tracking_uri=f"file://localhost{work / 'env-mlruns'}")
    runs = measured.search_runs([measured.get_experiment_by_name("peagle").experiment_id])
    assert len(runs) == 1 and "acceptance_length/measured_offline_chains" in runs[0].data.metrics
    assert (run / "logs" / "tensorboard").is_dir() and (report / "logs" / "tensorboard").is_dir()
    assert list((report / "logs" / "wandb").glob("offline-run-*/run-*.wandb"))  # W&B's run file was written
    exported = json.loads((export / "config.json").read_text())["peagle"]
    assert "hostname" not in exported["host"] and "platform" not in exported["host"]
    recorded = [exported["checkpoint"], *exported["run_config"].values(), *exported["run_config"]["store"]]
    assert not [v for v in recorded if isinstance(v, str) and v.startswith("/")], exported
    assert "mlflow_tracking_uri" not in exported["run_config"]


class AuthServer(http.server.ThreadingHTTPServer):
    """A server on 127.0.0.1 that answers /health to the right Basic credentials and refuses MLflow's
    API with 403 (as a tracking server refuses a user without rights), recording every request."""

    daemon_threads = True

    def __init__(self, user: str, password: str):
        self.wanted = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.seen: list[tuple[str, str | None]] = []  # (request line, Authorization header)
        super().__init__(("127.0.0.1", 0), _AuthHandler)
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    def __enter__(self) -> "AuthServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class _AuthHandler(http.server.BaseHTTPRequestHandler):
    timeout = 10  # seconds a connection may idle: the server stops itself from being held

    def _answer(self) -> None:
        auth = self.headers.get("Authorization")
        self.server.seen.append((self.requestline, auth))
        if auth != self.server.wanted:
            status, body = 401, {"error_code": "UNAUTHENTICATED", "message": "credentials required"}
        elif self.path.startswith("/health"):
            status, body = 200, {"status": "OK"}
        else:
            status, body = 403, {"error_code": "PERMISSION_DENIED", "message": "this test server keeps no runs"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


def test_a_user_pass_tracking_uri_reaches_the_server_as_a_header(train_baseline, runner, tmp_path, figures):
    """`--mlflow-tracking-uri http://alice:PASS@127.0.0.1:PORT` from a --config file: the pre-flight
    /health and MLflow's first API call both arrive with alice's Basic credentials and a request line
    without them; the server's 403 ends the run in one line that names the URI without the password."""
    password = f"pw-{uuid.uuid4().hex}"
    with AuthServer("alice", password) as server:
        team = tmp_path / "team.yaml"
        team.write_text(f"logger: mlflow\nmlflow_tracking_uri: http://alice:{password}@127.0.0.1:"
                        f"{server.server_address[1]}\n")
        result = runner.run("train", "--store", train_baseline.store, "--target", train_baseline.target, "--out",
                            tmp_path / "run", *train_flags(), "--config", team, env=no_tracker_env(tmp_path))
    figures.add(trials=1, bad_inputs_tried=1)
    error = one_line_error(result, "--logger mlflow failed to start its run", "PERMISSION_DENIED")
    assert password not in result.stdout + result.stderr, result.describe()
    lines = [line for line, _ in server.seen]
    assert lines[0] == "GET /health HTTP/1.1" and any("/api/2.0/mlflow/" in line for line in lines), server.seen
    assert all(auth == server.wanted for _, auth in server.seen), server.seen
    assert not [line for line in lines if password in line or "alice" in line]
    assert files_holding(tmp_path, [password]) == [str(team.relative_to(tmp_path))], error
    figures.add(bad_inputs_handled=1)
