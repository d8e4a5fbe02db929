"""The quantized all-reduce of DiLoCo's pseudo-gradients on real gloo ranks: every rank gets the same bits,
and they are the bits the simulator computes in one process (``EncodedMean.mean``)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch
import torch.distributed as dist

from gasloc_lightning.algorithm.round import EncodedMean
from gasloc_lightning.comm.transport import GossipTransport

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

NUMEL = 1001  # not a multiple of the block or of the world size: padding is exercised


def vectors(world_size: int) -> torch.Tensor:
    return torch.randn(world_size, NUMEL, generator=torch.Generator().manual_seed(7)) * 1e-2


def _rank(rank: int, world_size: int, port: int, codec: str, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        transport = GossipTransport(NUMEL, torch.device("cpu"), timeout=30.0)
        tensor = vectors(world_size)[rank].clone()
        transport.all_reduce_mean_encoded(tensor, codec)
        again = vectors(world_size)[rank].clone()
        transport.all_reduce_mean_encoded(again, codec)  # buffers reused: the same result
        queue.put((rank, tensor.numpy().tobytes(), again.numpy().tobytes(), transport.counters.bytes_sent))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("codec,world_size", [("int8", 3), ("int4", 2), ("bfloat16", 3)])
def test_every_rank_gets_the_simulators_bits(codec, world_size, fresh_port, one_torch_thread):
    context = mp.get_context("fork")  # one torch thread in this process: a forked rank starts in milliseconds
    queue = context.Queue()
    port = fresh_port()
    processes = [context.Process(target=_rank, args=(r, world_size, port, codec, queue)) for r in range(world_size)]
    for process in processes:
        process.start()
    try:
        results = sorted(queue.get(timeout=90) for _ in range(world_size))
    finally:
        for process in processes:  # stopped by pid, on success and on failure
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
    expected = EncodedMean(codec, NUMEL, world_size).mean(vectors(world_size))
    exact = vectors(world_size).mean(dim=0)
    chunk_wire = EncodedMean(codec, NUMEL, world_size).chunk_wire
    for rank, first, second, bytes_sent in results:
        got = torch.frombuffer(bytearray(first), dtype=torch.float32)
        assert torch.equal(got, expected), f"rank {rank}"
        assert first == second
        assert bytes_sent == 2 * 2 * (world_size - 1) * chunk_wire  # two calls, 2 (n - 1) chunks each
    assert not torch.equal(expected, exact) and torch.allclose(expected, exact, atol=0.2 * exact.abs().max())
