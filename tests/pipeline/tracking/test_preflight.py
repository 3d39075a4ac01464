"""Before any work (peagle/pipeline/tracking/preflight.py): a tracker that cannot run is one line that
says what to do (the extra to install, the URL that did not answer, the login W&B needs), and W&B
without a login goes offline, saying so. Real imports, a real closed port; no network."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from peagle.pipeline.tracking.preflight import (has_wandb_login, mlflow_client_uri, plan_tracking, require,
                                                resolve_mlflow_uri, resolve_wandb_mode)
from peagle.schemas.errors import UserError
from peagle.schemas.tracking_config import TrackingOptions, parse_loggers


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def options(**kw) -> TrackingOptions:
    opts = TrackingOptions(**kw)
    opts.check_tracking()
    return opts


def test_logger_takes_a_comma_list_of_backends_or_none():
    assert parse_loggers("none") == () and parse_loggers("") == ()
    assert parse_loggers("wandb, tensorboard,wandb") == ("tensorboard", "wandb")
    assert parse_loggers(["wandb", "tensorboard"]) == ("tensorboard", "wandb")  # a config file's list
    assert options(logger="MLflow,trackio").logger == "mlflow,trackio"
    with pytest.raises(UserError, match=r"--logger takes a comma list of tensorboard,wandb,mlflow,trackio \(or none\), "
                                        "got 'tensorboard,comet'"):
        parse_loggers("tensorboard,comet")
    with pytest.raises(UserError, match="--wandb-mode must be one of auto|online|offline"):
        options(wandb_mode="cloud")


@pytest.mark.parametrize("name, module", [("wandb", "wandb"), ("mlflow", "mlflow"), ("trackio", "trackio"),
                                          ("tensorboard", "torch.utils.tensorboard")])
def test_a_backend_that_does_not_import_names_the_extra_to_install(name, module, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # what Python does for a package that is not there
    with pytest.raises(UserError) as err:
        require(name)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"--logger {name} needs the ") and line.endswith(
        f"pip install 'peagle[{name}]'")


def test_nothing_asked_is_no_plan(tmp_path):
    assert plan_tracking(options(), log_dir=tmp_path, run_name="r", mlflow_default="file:x") is None


def test_an_mlflow_server_that_does_not_answer_is_one_line_naming_the_url():
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(UserError) as err:
        resolve_mlflow_uri(url, "file:/x", {})
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"--logger mlflow: cannot reach {url}/health (")
    assert "--mlflow-tracking-uri" in line


def test_the_mlflow_store_is_the_flag_else_the_environment_else_the_run_directory():
    assert resolve_mlflow_uri(None, "file:/run/mlruns", {}) == "file:/run/mlruns"
    assert resolve_mlflow_uri(None, "file:/run/mlruns", {"MLFLOW_TRACKING_URI": "file:/env"}) == "file:/env"
    assert resolve_mlflow_uri("file:/flag", "file:/run/mlruns", {"MLFLOW_TRACKING_URI": "file:/env"}) == "file:/flag"


def test_wandb_without_a_login_goes_offline_and_says_how_to_upload(tmp_path):
    environ = {"NETRC": str(tmp_path / "none"), "HOME": str(tmp_path)}
    assert not has_wandb_login(environ)
    mode, note = resolve_wandb_mode("auto", environ, tmp_path / "logs")
    assert mode == "offline" and "no login here" in note and f"wandb sync {tmp_path / 'logs' / 'wandb'}" in note
    assert resolve_wandb_mode("auto", {**environ, "WANDB_MODE": "offline"}, tmp_path) == ("offline", None)
    assert resolve_wandb_mode("offline", environ, tmp_path) == ("offline", None)
    with pytest.raises(UserError, match="--wandb-mode online needs a W&B login: run `wandb login` or set WANDB_API_KEY"):
        resolve_wandb_mode("online", environ, tmp_path)


def test_a_wandb_login_is_an_api_key_or_a_netrc_entry_for_its_server(tmp_path):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine wandb.example.org\n  login user\n  password secret\n")
    netrc.chmod(0o600)
    environ = {"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.org"}
    assert has_wandb_login(environ) and has_wandb_login({"WANDB_API_KEY": "k", "NETRC": str(tmp_path / "none")})
    assert not has_wandb_login({"NETRC": str(netrc)})  # an entry for another server


def test_wandb_online_with_a_server_that_does_not_answer_is_one_line_naming_the_url(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(UserError) as err:
        resolve_wandb_mode("online", {"WANDB_API_KEY": "k", "WANDB_BASE_URL": url}, tmp_path)
    assert "\n" not in str(err.value) and str(err.value).startswith(f"--logger wandb: cannot reach {url} (")


def test_a_plan_resolves_every_default(tmp_path):
    pytest.importorskip("tensorboard")
    plan = plan_tracking(options(logger="tensorboard", run_name="mine"), log_dir=tmp_path / "logs", run_name="run",
                         mlflow_default="file:/x")
    assert plan.loggers == ("tensorboard",) and plan.run_name == "mine" and plan.log_dir == tmp_path / "logs"
    plan = plan_tracking(options(logger="tensorboard", logger_dir=str(tmp_path / "elsewhere")), log_dir=Path("unused"),
                         run_name="run", mlflow_default="file:/x")
    assert plan.log_dir == tmp_path / "elsewhere" and plan.run_name == "run" and plan.mlflow_uri is None


def test_mlflow_gets_its_uri_without_credentials_and_them_apart():
    environ = {"MLFLOW_TRACKING_URI": "http://bob:envpw@h:5000"}
    assert mlflow_client_uri("http://alice:s3cret@mlflow:5000", environ) == "http://mlflow:5000"
    assert environ == {"MLFLOW_TRACKING_URI": "http://h:5000", "MLFLOW_TRACKING_USERNAME": "alice",
                       "MLFLOW_TRACKING_PASSWORD": "s3cret"}
    environ = {}
    assert mlflow_client_uri("https://mlflow/?token=t0k", environ) == "https://mlflow/"
    assert environ == {"MLFLOW_TRACKING_TOKEN": "t0k"}
    assert mlflow_client_uri("file:/data/mlruns", environ) == "file:/data/mlruns" and len(environ) == 1
