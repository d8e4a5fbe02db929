"""The quantized all-reduce of DiLoCo's pseudo-gradients on real gloo ranks: every rank gets the same bits,
and they are the bits the simulator computes in one process (``EncodedMean.mean``); posted asynchronously
(Streaming DiLoCo's overlap) it gives the blocking bits, and it runs while the rank computes."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch
import torch.distributed as dist

from gasloc_lightning.algorithm.round import EncodedMean
from gasloc_lightning.comm.encoded_mean import AsyncEncodedMean
from gasloc_lightning.comm.transport import GossipTimeoutError, GossipTransport

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120), pytest.mark.usefixtures("threads_safe_to_fork")]

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
    results = _fork_ranks(_rank, world_size, fresh_port(), codec)  # one torch thread here: forks start fast
    expected = EncodedMean(codec, NUMEL, world_size).mean(vectors(world_size))
    exact = vectors(world_size).mean(dim=0)
    chunk_wire = EncodedMean(codec, NUMEL, world_size).chunk_wire
    for rank, first, second, bytes_sent in results:
        got = torch.frombuffer(bytearray(first), dtype=torch.float32)
        assert torch.equal(got, expected), f"rank {rank}"
        assert first == second
        assert bytes_sent == 2 * 2 * (world_size - 1) * chunk_wire  # two calls, 2 (n - 1) chunks each
    assert not torch.equal(expected, exact) and torch.allclose(expected, exact, atol=0.2 * exact.abs().max())


def _fork_ranks(target, world_size: int, port: int, *args) -> list:
    """Run ``target(rank, world_size, port, *args, queue)`` on forked ranks; their results, sorted by rank."""
    context = mp.get_context("fork")
    queue = context.Queue()
    processes = [context.Process(target=target, args=(r, world_size, port, *args, queue)) for r in range(world_size)]
    for process in processes:
        process.start()
    try:
        return sorted(queue.get(timeout=90) for _ in range(world_size))
    finally:
        for process in processes:  # stopped by pid, on success and on failure
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()


SIZES = (1001, 333)  # two fragments of different sizes, both in flight at once


def _posted_rank(rank: int, world_size: int, port: int, codec: str, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        transport = GossipTransport(NUMEL, torch.device("cpu"), timeout=30.0)
        transport.open_encoded_means([list(range(world_size))], rank)
        blocking, posted = [], []
        for size in (*SIZES, SIZES[0]):
            blocking.append(transport.all_reduce_mean_encoded(vectors(world_size)[rank, :size].clone(), codec))
        bytes_blocking = transport.counters.bytes_sent
        pending = [transport.post_all_reduce_mean_encoded(vectors(world_size)[rank, :size].clone(), codec)
                   for size in SIZES]
        dist.barrier()  # a collective of the world's group while the means are in flight on their own group
        posted = [transport.wait_all_reduce_mean_encoded(p) for p in reversed(pending)][::-1]
        again = transport.post_all_reduce_mean_encoded(vectors(world_size)[rank, :SIZES[0]].clone(), codec)
        posted.append(transport.wait_all_reduce_mean_encoded(again))  # buffers reused once waited on
        queue.put((rank, [t.numpy().tobytes() for t in blocking], [t.numpy().tobytes() for t in posted],
                   bytes_blocking, transport.counters.bytes_sent - bytes_blocking))
        transport.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("codec,world_size", [("int4", 2), ("int8", 3)])
def test_a_posted_mean_has_the_blocking_means_bits(codec, world_size, fresh_port, one_torch_thread):
    results = _fork_ranks(_posted_rank, world_size, fresh_port(), codec)
    for rank, blocking, posted, bytes_blocking, bytes_posted in results:
        assert posted == blocking, f"rank {rank}"
        assert bytes_posted == bytes_blocking  # counted as the blocking means are
    assert results[0][2] == results[-1][2]  # every rank holds the same bits


def _gated_rank(rank: int, world_size: int, port: int, computed, queue) -> None:
    """Rank 0 posts, then computes; rank 1 joins the mean only once rank 0's compute is done (a link that is
    as slow as it gets), so rank 0's compute can only have run while its mean was in flight."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        transport = GossipTransport(NUMEL, torch.device("cpu"), timeout=30.0)
        transport.open_encoded_means([list(range(world_size))], rank)
        events = []
        if rank == 1 and not computed.wait(timeout=60):
            raise TimeoutError("rank 0 never computed: its post blocked")
        pending = transport.post_all_reduce_mean_encoded(vectors(world_size)[rank].clone(), "int4")
        events.append("posted")
        if rank == 0:
            torch.randn(64, 64).matmul(torch.randn(64, 64))  # the round's compute
            events.append("in flight after compute" if not pending.future.done() else "done before compute")
            computed.set()
        mean = transport.wait_all_reduce_mean_encoded(pending)
        events.append("landed")
        queue.put((rank, events, mean.numpy().tobytes()))
        transport.close()
    finally:
        dist.destroy_process_group()


def test_a_rank_computes_while_its_posted_mean_waits_for_a_late_peer(fresh_port, one_torch_thread):
    computed = mp.get_context("fork").Event()
    results = _fork_ranks(_gated_rank, 2, fresh_port(), computed)
    assert results[0][1] == ["posted", "in flight after compute", "landed"]
    assert results[1][1] == ["posted", "landed"]
    expected = EncodedMean("int4", NUMEL, 2).mean(vectors(2))
    for _, _, bits in results:
        assert torch.equal(torch.frombuffer(bytearray(bits), dtype=torch.float32), expected)


def _abandoned_rank(rank: int, world_size: int, port: int, queue) -> None:
    """Rank 1 never posts its part: rank 0's wait must end with an error naming the deadline, not hang."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        transport = GossipTransport(NUMEL, torch.device("cpu"), timeout=2.0)
        transport.open_encoded_means([list(range(world_size))], rank)
        if rank == 1:
            queue.put((rank, None))
            return
        pending = transport.post_all_reduce_mean_encoded(vectors(world_size)[rank].clone(), "int4")
        try:
            transport.wait_all_reduce_mean_encoded(pending)
            queue.put((rank, "completed"))
        except GossipTimeoutError as error:
            queue.put((rank, str(error)))
    finally:
        if rank == 0:
            dist.destroy_process_group()


def test_a_posted_mean_whose_peer_never_comes_fails_at_the_deadline(fresh_port, one_torch_thread):
    results = _fork_ranks(_abandoned_rank, 2, fresh_port())
    assert "gossip_timeout=2s" in results[0][1], results[0][1]
    with pytest.raises(ValueError, match="timeout must be > 0 seconds"):
        AsyncEncodedMean(None, timeout=0, device=torch.device("cpu"))
