"""The two-level round on real gloo ranks (comm/two_level.py): region means on subgroups and the shard-parallel
crossing give the simulator's points (sim/two_level.py), and each level's bytes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from gasloc_lightning.algorithm.two_level import TwoLevelRound
from gasloc_lightning.comm.two_level import RegionTransport
from gasloc_lightning.sim import TwoLevelRounds, WorkerClocks
from gasloc_lightning.topology.regions import TwoLevelTopology
from test_quantized_all_reduce import _fork_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

NUMEL, ROUNDS, LAYOUT = 1001, 7, ["us", "eu", "us", "eu"]  # numel not a multiple of m: the shards are padded
# Three regions whose l-th ranks are not in region order (column 1: ranks 3, 2, 5): a process group orders its
# ranks by rank, and the quantized mean sums in that order, as the simulator must.
THREE_REGIONS = ["b", "a", "a", "b", "c", "c"]


def local_progress(round_index: int, workers: int = len(LAYOUT)) -> torch.Tensor:
    """What each rank's inner steps add to its round start in round t (n, P)."""
    return torch.randn(workers, NUMEL, generator=torch.Generator().manual_seed(round_index))


def topology(region_topology: str, delayed: bool = False, codec: str = "float32",
             layout: list[str] = LAYOUT) -> TwoLevelTopology:
    return TwoLevelTopology(layout, cross_every=2, region_topology=region_topology, cross_overlap=delayed,
                            cross_codec=codec)


def _rank(rank: int, world_size: int, port: int, region_topology: str, delayed: bool, codec: str, layout: list[str],
          queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        two_level = topology(region_topology, delayed, codec, layout)
        rule = two_level.rule(region_lr=0.7, region_momentum=0.9)
        transport = RegionTransport(two_level.regions, rank, delayed=delayed, timeout=60.0, codec=codec,
                                    cross_mean=rule.cross_mean)
        round_ = TwoLevelRound(torch.zeros(NUMEL), rule=rule, num_regions=two_level.regions.num_regions)
        pending = None
        for t in range(ROUNDS):
            delta = round_.pseudo_gradient(round_.region_start.detach() + local_progress(t, world_size)[rank])
            round_.region_step(transport.region_mean_(delta))
            if round_.crosses(t):
                if pending is not None:  # the delayed crossing: the last one lands, under this round's region mean
                    transport.land_cross(pending, round_.cross_destination)
                    round_.cross_land()
                u = round_.cross_message()
                peers = None if rule.cross_mean else two_level.cross_peers(rank, t)
                if delayed:
                    pending = transport.post_cross(u, peers)
                elif peers is None:  # a quantized mean averages the change since the last one (the round start)
                    posted = transport.post_cross(u, None, reference=round_.last_mix)
                    transport.land_cross(posted, round_.cross_destination)
                else:
                    transport.cross_mix(u, round_.cross_destination, peers)
                round_.cross_finish()
        if pending is not None:
            transport.land_cross(pending, round_.cross_destination)
            round_.cross_land()
            round_.fold_correction()
        queue.put((rank, round_.region_start.detach().numpy().tobytes(), transport.level_bytes()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("region_topology", "delayed", "codec", "layout"), [
    ("one_peer", False, "float32", LAYOUT), ("complete", False, "float32", LAYOUT),
    ("one_peer", True, "float32", LAYOUT), ("complete", True, "float32", LAYOUT), ("one_peer", False, "int8", LAYOUT), ("one_peer", True, "int4", LAYOUT),
    ("complete", False, "int4", LAYOUT), ("complete", False, "int8", THREE_REGIONS)],
    ids=["gossip", "mean", "gossip-delayed", "mean-delayed", "gossip-int8", "gossip-delayed-int4", "mean-int4",
         "mean-int8-three-regions"])
def test_ranks_compute_the_simulators_points_and_bytes(region_topology, delayed, codec, layout, fresh_port,
                                                       one_torch_thread):
    n = len(layout)
    results = _fork_ranks(_rank, n, fresh_port(), region_topology, delayed, codec, layout)
    two_level = topology(region_topology, delayed, codec, layout)
    sim = TwoLevelRounds(initial=torch.zeros(n, NUMEL), topology=two_level,
                         rule=two_level.rule(region_lr=0.7, region_momentum=0.9), clocks=WorkerClocks(None, n))
    flat = torch.zeros(n, NUMEL)
    for t in range(ROUNDS):
        flat += local_progress(t, n)
        sim.communicate(flat, t, list(range(n)))
    sim.flush(flat)
    for rank, point, level_bytes in results:
        got = torch.frombuffer(bytearray(point), dtype=torch.float32)
        torch.testing.assert_close(got, flat[rank], rtol=1e-6, atol=1e-5)  # gloo sums 4 ranks in its order
        assert level_bytes["comm/bytes_region"] == float(sim.bytes_region[rank])  # 7 all-reduces among 2
        assert level_bytes["comm/bytes_cross"] == pytest.approx(float(sim.bytes_cross[rank]), rel=1e-3)  # padding
    assert not torch.allclose(flat[0], flat[1])  # the regions differ between crossings (t = 6 is a region round)


def _poisoned_rank(rank: int, world_size: int, port: int, region_topology: str, codec: str, queue) -> None:
    """Two regions of one rank; rank 1 sends a message with a NaN."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        two_level = TwoLevelTopology([0, 1], cross_every=1, region_topology=region_topology, cross_overlap=True,
                                     cross_codec=codec)
        transport = RegionTransport(two_level.regions, rank, delayed=True, timeout=60.0, codec=codec)
        message = torch.full((300,), float(rank + 1))
        if rank == 1:
            message[7] = float("nan")
        peers = None if region_topology == "complete" else two_level.cross_peers(rank, 0)
        destination = torch.empty(300)
        rejected = transport.land_cross(transport.post_cross(message, peers), destination)
        queue.put((rank, rejected, bool(torch.isfinite(destination).all()), float(destination[0])))
    finally:
        dist.destroy_process_group()


def _rejected_mean_rank(rank: int, world_size: int, port: int, queue) -> None:
    """Two regions of one rank, hierarchical DiLoCo's int8 mean: rank 1's first message has a NaN (the mean is
    refused, each keeps its own message, as its round start), the second crossing's messages are finite."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        transport = RegionTransport(TwoLevelTopology([0, 1], region_topology="complete", cross_codec="int8").regions,
                                    rank, timeout=60.0, codec="int8", cross_mean=True)
        point = torch.zeros(300)  # the round start every rank shares at first
        first = torch.full((300,), float(rank + 1))
        if rank == 1:
            first[7] = float("nan")
        rejected = transport.land_cross(transport.post_cross(first, None, reference=point), point)  # point: own now
        point = torch.nan_to_num(point)  # each region's own (diverged) round start, made finite again
        second = point + 0.5 * (rank + 1)  # and its next change from there
        destination = torch.empty(300)
        transport.land_cross(transport.post_cross(second, None, reference=point), destination)
        queue.put((rank, rejected, destination.numpy().tobytes()))
    finally:
        dist.destroy_process_group()


def test_a_refused_quantized_mean_leaves_the_next_one_common_to_every_region(fresh_port, one_torch_thread):
    """After a refused mean each region's round start is its own message; the next quantized mean is taken from the
    last accepted one (kept by the transport), so the regions land on one point again."""
    results = dict((rank, (rejected, point)) for rank, rejected, point in _fork_ranks(_rejected_mean_rank, 2,
                                                                                     fresh_port()))
    assert results[0][0] == [-1] and results[1][0] == [-1]
    points = [torch.frombuffer(bytearray(results[rank][1]), dtype=torch.float32) for rank in (0, 1)]
    assert torch.equal(points[0], points[1]) and bool(torch.isfinite(points[0]).all())


@pytest.mark.parametrize(("region_topology", "codec"), [("one_peer", "float32"), ("one_peer", "int8"),
                                                        ("complete", "float32")])
def test_a_shard_or_mean_that_is_not_finite_is_left_out_and_reported(region_topology, codec, fresh_port,
                                                                       one_torch_thread):
    """As the one-level gossip drops a non-finite message: rank 0 keeps its own share and names the peer (-1: the
    world mean); before, the NaN entered its region point for good."""
    results = _fork_ranks(_poisoned_rank, 2, fresh_port(), region_topology, codec)
    rank0 = results[0]
    assert rank0[1] == ([-1] if region_topology == "complete" else [1])
    assert rank0[2] and rank0[3] == pytest.approx(1.0, abs=0.01)  # its own message, finite
