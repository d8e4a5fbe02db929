"""Shared fixtures: a fresh port per launch; no leaked environment, thread count or process group between tests."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

# OMP_NUM_THREADS too: Lightning's launchers set it in the launching process, and a later test's forked
# workers would then keep the parent's thread count.
# The fused round is chosen by size unless forced: a value in the user's environment must not change the suite.
os.environ.pop("GASLOC_FUSED_ROUND", None)

_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
             "OMP_NUM_THREADS")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(autouse=True)
def _restore_distributed_state():
    saved = {key: os.environ.get(key) for key in _DIST_ENV}
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def fresh_port(monkeypatch):
    """Writes a free port to MASTER_PORT now; call the returned function before each further launch."""

    def new_port() -> int:
        port = free_port()
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        return port

    new_port()
    return new_port


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: one thread is faster, and avoids oversubscription next to other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
