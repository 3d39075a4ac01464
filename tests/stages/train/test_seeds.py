"""``stable_seed``: a seed from a key alone, the same in every process."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given, strategies as st

from peagle.stages.train.seeds import stable_seed


@given(st.lists(st.one_of(st.integers(0, 2**40), st.text(max_size=12)), min_size=1, max_size=4))
def test_a_seed_is_a_non_negative_int64_that_the_key_alone_decides(key):
    seed = stable_seed(*key)
    assert 0 <= seed < 2**63 and seed == stable_seed(*key)


def test_the_key_is_read_whole_and_in_order():
    assert len({stable_seed(1, 23), stable_seed(12, 3), stable_seed(23, 1), stable_seed("1", 23)}) == 4
    assert stable_seed(0, 0) != stable_seed(0, 1)  # two ranks of one run


def test_another_process_derives_the_same_seed():  # no salted hash() anywhere in it
    code = "from peagle.stages.train.seeds import stable_seed; print(stable_seed(7, 'shard-3:12'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) == stable_seed(7, "shard-3:12")
