"""EvalConfig's checks of the live-server flags: each mistake is one UserError line, before any work."""

from __future__ import annotations

import pytest

from peagle.schemas.errors import UserError
from peagle.schemas.eval_config import ALL_EVAL_MODES, EVAL_MODES, EvalConfig


def test_server_is_a_mode_of_eval_but_not_of_the_local_list():
    assert ALL_EVAL_MODES == (*EVAL_MODES, "server") and "server" not in EVAL_MODES  # the demo takes EVAL_MODES
    assert EvalConfig(source="e", server="http://h:8000", mode=("online", "server")).server == "http://h:8000"
    assert EvalConfig(source="e", server="https://h/").mode is None  # the default modes then include server


@pytest.mark.parametrize("fields, needle", [
    ({"mode": ("server",)}, "--mode server measures a running vLLM server: pass its URL"),
    ({"mode": ("online",), "server": "http://h:8000"}, "add server to --mode"),
    ({"server": "localhost:8000"}, "--server takes the server's base URL"),
    ({"server": "http://h:8000", "temperature": 0.7}, "--server measures greedy decoding"),
    ({"mode": ("online", "served")}, "--mode takes a comma list of offline,online,vllm,server"),
])
def test_server_mistakes_are_one_line(fields, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(")) as err:
        EvalConfig(source="e", **fields)
    assert "\n" not in str(err.value)
