"""A hidden-states KV connector for vLLM that works on CPU as well as on GPU.

vLLM's ``extract_hidden_states`` speculative method caches, per token, the target's hidden stream
at the ``eagle_aux_hidden_state_layer_ids`` in a cache-only KV layer; a KV connector then dumps
each finished request's rows into one safetensors file (``hidden_states`` ``[T, L, H]``,
``token_ids`` ``[T]``) and returns its path in ``RequestOutput.kv_transfer_params``. The stock
``ExampleHiddenStatesConnector`` copies through pinned memory on a CUDA stream, which fails on a
CPU-only build. This subclass keeps its file protocol (async write from a thread pool, a ``.lock``
companion file held exclusively until the write is done) and only replaces the copy on CPU.

The staging dir the dumps go to lives here too: it is RAM (``/dev/shm``) when there is room, so a
dir left by a killed run is found and removed by the next one (``StagingDir``).

vLLM imports this module by name in its engine process (``kv_connector_module_path``), so it must
stay importable on its own and must not import the rest of peagle.

Shape legend: T tokens of one request, L dumped layers, H hidden size.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
)

CONNECTOR_NAME = "PeagleHiddenStatesConnector"
MODULE_PATH = __name__

STAGING_PREFIX = "peagle-vllm-"
_OWNER_LOCK = "owner.lock"
_SHM_MIN_FREE_BYTES = 1 << 30


class _AlreadyDone:
    """Stands in for the CUDA event the parent waits on: a CPU copy is complete when it returns."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class PeagleHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` whose device-to-host copy also works when the cache is on CPU."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            super()._submit_async_write(pending)  # GPU: pinned memory + copy stream are right
            return
        if not self._is_tp_rank_zero:
            return
        # The cache is [num_blocks, L, block_size, H]; a request's rows are its blocks in order.
        block_size = self._kv_cache.shape[2]
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
        num_tokens = pending.token_ids.shape[0]
        slots = slots[:num_tokens]
        # Advanced indexing copies, so the rows stay valid after the scheduler frees the blocks.
        hidden_TLH = self._kv_cache[slots // block_size, :, slots % block_size]
        tensors = {"hidden_states": hidden_TLH, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _AlreadyDone()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done  # tells get_finished the blocks may be freed
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, req_id=pending.req_id: self._on_write_done(req_id, f))


def read_hidden_states(path: str, timeout_s: float = 600.0) -> dict[str, Any]:
    """Read one request's dump once its writer is done, then delete the file and its lock file.

    The writer holds an exclusive ``flock`` on ``path + ".lock"`` from before vLLM hands out the
    path until the file is complete; a shared lock therefore waits exactly as long as needed. We
    poll rather than block so that a write that never comes is an error, not a hang.

    Raises:
        TimeoutError: the writer did not finish within ``timeout_s``.
    """
    lock_path = path + ".lock"
    deadline = time.monotonic() + timeout_s
    with open(lock_path) as lock_file:
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM never finished writing {path}") from None
                time.sleep(0.002)
        tensors = load_file(path, device="cpu")
    os.remove(lock_path)
    os.remove(path)
    return tensors


class StagingDir:
    """A fresh dump dir, on ``/dev/shm`` when it has >= 1 GiB free, else in the system temp dir.

    The owning process holds an exclusive ``flock`` on ``owner.lock`` inside it for its lifetime.
    The kernel drops that lock when the process dies (``kill -9`` included), so a new ``StagingDir``
    removes every ``peagle-vllm-*`` dir whose lock it can take: those of dead runs, whatever pid
    namespace they ran in. The dir gets its scanned name only once locked, so a live dir is never
    taken for a dead one.
    """

    def __init__(self) -> None:
        shm = Path("/dev/shm")
        use_shm = shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= _SHM_MIN_FREE_BYTES
        base = shm if use_shm else Path(tempfile.gettempdir())
        _remove_dead_staging_dirs(base)
        making = Path(tempfile.mkdtemp(prefix="making-" + STAGING_PREFIX, dir=base))
        self._lock_fd: int | None = os.open(making / _OWNER_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self.path = base / making.name.removeprefix("making-")
        os.rename(making, self.path)

    def close(self) -> None:
        """Delete the dir and everything in it."""
        if self._lock_fd is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._lock_fd)
            self._lock_fd = None


def _remove_dead_staging_dirs(base: Path) -> None:
    for path in base.glob(STAGING_PREFIX + "*"):
        try:
            fd = os.open(path / _OWNER_LOCK, os.O_RDWR)
        except OSError:
            continue  # not a staging dir of ours (or already gone)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its owner is alive
        else:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
