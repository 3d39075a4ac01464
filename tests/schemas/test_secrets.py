"""The one redaction (peagle/schemas/secrets.py): credentials in URLs and secret-named environment
values never leave the process in what peagle writes; a client gets its URI without them."""

from __future__ import annotations

from peagle.schemas.secrets import MARK, Credentials, redact, redact_text, secret_env_values, split_credentials

ENV = {"HF_TOKEN": "hf_abcdefghijklmnop", "WANDB_API_KEY": "0123456789abcdef", "MLFLOW_TRACKING_PASSWORD": "s3cret-pw",
       "TOKENIZERS_PARALLELISM": "false", "SSH_AUTH_SOCK": "/tmp/ssh-abcdefgh/agent.1", "SHORT_TOKEN": "abc",
       "MLFLOW_TRACKING_USERNAME": "alice-the-user"}


def test_urls_lose_their_credentials_and_keep_the_rest():
    assert redact_text("http://alice:s3cr%40t@mlflow:5000/x", {}) == f"http://alice:{MARK}@mlflow:5000/x"
    assert redact_text("https://ghp_token123@github.com/o/r", {}) == f"https://{MARK}@github.com/o/r"
    assert redact_text("file://bob:pw@localhost/data/mlruns", {}) == f"file://bob:{MARK}@localhost/data/mlruns"
    assert redact_text("http://h/api?run=1&token=abc&X-Amz-Signature=f00&api_key=k#top", {}) == \
        f"http://h/api?run=1&token={MARK}&X-Amz-Signature={MARK}&api_key={MARK}#top"
    line = "--logger mlflow: cannot reach http://alice:pw@127.0.0.1:9/health (Connection refused)"
    assert redact_text(line, {}) == f"--logger mlflow: cannot reach http://alice:{MARK}@127.0.0.1:9/health " \
                                    "(Connection refused)"
    for harmless in ("http://mlflow.internal:5000", "/data/store:0.5", "mail alice@example.com", "file:/x?monkey=1"):
        assert redact_text(harmless, {}) == harmless


def test_secret_named_environment_values_are_replaced_wherever_they_appear():
    text = "HF hf_abcdefghijklmnop, W&B 0123456789abcdef, pw s3cret-pw, abc, false, /tmp/ssh-abcdefgh/agent.1"
    assert redact_text(text, ENV) == f"HF {MARK}, W&B {MARK}, pw {MARK}, abc, false, /tmp/ssh-abcdefgh/agent.1"
    assert redact_text("user alice-the-user", ENV) == "user alice-the-user"  # a user name is not a secret


def test_redact_walks_configs_and_keeps_their_shape():
    config = {"mlflow_tracking_uri": "http://a:b@h", "store": ["/s:0.5"], "pair": ("x", 1), "none": None,
              "nested": {"token": "hf_abcdefghijklmnop"}, "lr": 0.1}
    assert redact(config, ENV) == {"mlflow_tracking_uri": f"http://a:{MARK}@h", "store": ["/s:0.5"], "pair": ("x", 1),
                                   "none": None, "nested": {"token": MARK}, "lr": 0.1}


def test_a_client_gets_the_uri_without_its_credentials():
    assert split_credentials("http://alice:s3cr%40t@mlflow:5000/x?token=t&b=2") == Credentials(
        "http://mlflow:5000/x?b=2", "alice", "s3cr@t", "t")
    assert split_credentials("file://bob:pw@localhost/data/mlruns") == Credentials(
        "file://localhost/data/mlruns", "bob", "pw", None)
    assert split_credentials("file:/data/mlruns?token=x") == Credentials("file:/data/mlruns", None, None, "x")
    assert split_credentials("http://mlflow:5000") == Credentials("http://mlflow:5000")


def test_the_working_directory_is_a_path_not_a_secret():
    """PWD holds where a command was started: taken for a secret, every path under it was redacted
    (a run started in /data saved ``***/store`` and refused its own resume); ``?pwd=`` stays secret."""
    env = {"PWD": "/data/team", "OLDPWD": "/data/team/old", "DB_PWD": "hunter2-long-enough"}
    assert secret_env_values(env) == ["hunter2-long-enough"]
    assert redact("--store /data/team/store", env) == "--store /data/team/store"
    assert "s3cr3t" not in redact_text("https://h/x?pwd=s3cr3t-value", env)
