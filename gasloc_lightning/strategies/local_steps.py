"""The round machinery shared by GASLoC and DiLoCo: H local optimizer steps, then a communication round.

``LocalStepsStrategy`` is Lightning's ``DDPStrategy`` without the DDP wrapper between workers (no
gradient all-reduce): its ``setup`` is DDPStrategy's, and the round hooks in at ``optimizer_step``.
It reads as a list of collaborators, each with one concern and its own tests:

- :class:`~gasloc_lightning.strategies.schedule.RoundSchedule`: H_i and where each rank stands;
- :class:`~gasloc_lightning.comm.flat.FlatLayout`: the model lives in one flat vector that a round
  reads and writes in place;
- :class:`~gasloc_lightning.comm.transport.GossipTransport`: point-to-point exchanges and all-reduces;
- :class:`~gasloc_lightning.strategies.guards.NonFiniteGuard`: non-finite points and messages;
- :class:`~gasloc_lightning.strategies.consensus.ConsensusSwap`: evaluation on the replicas' average;
- :class:`~gasloc_lightning.strategies.worker_groups.WorkerGroups`: workers of several ranks (DDP inside, or
  FSDP2 over a ``(workers, shards)`` mesh with shard-to-shard exchanges);
- :class:`~gasloc_lightning.strategies.round_clock.RoundClock`: the simulated clock, observing rounds;
- :class:`~gasloc_lightning.strategies.launcher.StoppingSubprocessLauncher`: no worker outlives its launcher;
- the per-rank checkpoint plugin (:mod:`gasloc_lightning.plugins`).

Subclasses implement ``_communicate``.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Callable, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from gasloc_lightning.algorithm.outer import all_finite
from gasloc_lightning.comm.flat import FlatLayout
from gasloc_lightning.comm.transport import GossipTransport
from gasloc_lightning.network import NetworkModel
from gasloc_lightning.network.clock import check_static_membership
from gasloc_lightning.plugins import per_rank as ckpt
from gasloc_lightning.plugins.per_rank_io import resolve_checkpoint_io
from gasloc_lightning.strategies.consensus import ConsensusSwap
from gasloc_lightning.strategies.guards import NonFiniteGuard, OnNonFinite
from gasloc_lightning.strategies import sharded_state
from gasloc_lightning.strategies.launcher import (
    ShardedResultsLauncher,
    StoppingSubprocessLauncher,
    exit_with_parent,
    release_process_group,
)
from gasloc_lightning.strategies.lightning_compat import _set_num_threads_if_needed, move_sigterm_check
from gasloc_lightning.strategies.round_clock import RoundClock
from gasloc_lightning.strategies.schedule import InnerSteps, RoundSchedule
from gasloc_lightning.strategies.worker_groups import IntraWorker, WorkerGroups

log = logging.getLogger(__name__)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class LocalStepsStrategy(DDPStrategy):
    """Base for strategies that train locally for H optimizer steps, then run a communication round.

    Args:
        inner_steps: H, optimizer steps between two rounds (>= 1), or one H_i per rank (the paper's
            heterogeneous workers): a round then lasts max(H_i) steps of the training loop on every rank,
            and a worker with a smaller H_i computes but does not apply its last max(H_i) - H_i steps.
            The ranks of one worker must share their H_i.
        gossip_timeout: seconds any point-to-point wait may take before failing with the round and peers named.
        collective_timeout: seconds the process group's collectives may take (default 2 x gossip_timeout).
        consensus_every: every this many rounds, all ranks measure the consensus distance together (0: never).
        bucket_cap_mb: largest single message slice, in MiB.
        cpu_threads: torch threads per process on CPU: ``"auto"`` leaves it to Lightning's launchers (cores
            / local processes, unless ``OMP_NUM_THREADS`` is set), an int sets it, ``None`` leaves torch's.
            Forked workers (``start_method="fork"``) always run one thread: OpenMP does not survive a fork.
        on_nonfinite: ``"skip_round"`` or ``"raise"`` (see :mod:`gasloc_lightning.strategies.guards`).
        max_skipped_rounds: consecutive skipped rounds after which the worker stops with an error.
        ranks_per_worker: k ranks (e.g. the GPUs of one node) form one worker: DDP or FSDP inside the worker,
            gossip between workers (see :mod:`gasloc_lightning.strategies.worker_groups`).
        intra_worker: ``"ddp"`` (every rank holds the worker's whole replica; its first rank exchanges) or
            ``"fsdp"``: the k ranks shard parameters, gradients, optimizer and outer state with FSDP2 over a
            ``(workers, shards)`` device mesh, and rank r of a worker exchanges shard r with rank r of its peers.
            The LightningModule shards itself in ``configure_model`` over ``self.device_mesh["shards"]``
            (Lightning's ``ModelParallelStrategy`` convention).
        worker_ddp_kwargs: keyword arguments of ``DistributedDataParallel`` inside a worker
            (``ranks_per_worker > 1``), e.g. ``{"gradient_as_bucket_view": True}``.
        network: a :class:`~gasloc_lightning.network.NetworkModel` over the workers: every rank then keeps a
            simulated clock, logged as ``sim_time``. Training itself is unchanged.
        fastest_inner_steps: with ``inner_steps="auto"``, H of the fastest worker; the others get H_i in
            proportion to their speed in ``network``, so rounds take equal time.
        trust_checkpoint_code: load checkpoint files that a safe load (``weights_only=True``) refuses, e.g.
            hyper-parameters holding arbitrary objects. Unpickling them runs code stored in the file: only for
            files you trust. (Lightning 2.6 does not pass ``Trainer.fit(..., weights_only=False)`` on to a
            strategy that restores after setup, as this one does; a direct ``load_checkpoint`` call honours it.)
        checkpoint_io: a :class:`~gasloc_lightning.plugins.per_rank_io.PerRankCheckpointIO` (the default), e.g.
            with ``storage_options``, or Lightning's ``AsyncCheckpointIO`` around one.
        accelerator, parallel_devices, cluster_environment, precision_plugin,
        process_group_backend, start_method: as in Lightning's ``DDPStrategy``.
    """

    def __init__(
        self,
        *,
        inner_steps: InnerSteps = 50,
        gossip_timeout: float = 300.0,
        collective_timeout: float | None = None,
        consensus_every: int = 10,
        bucket_cap_mb: float = 64.0,
        cpu_threads: int | Literal["auto"] | None = "auto",
        on_nonfinite: OnNonFinite = "skip_round",
        max_skipped_rounds: int = 3,
        ranks_per_worker: int = 1,
        intra_worker: IntraWorker = "ddp",
        worker_ddp_kwargs: Mapping[str, Any] | None = None,
        network: NetworkModel | None = None,
        fastest_inner_steps: int = 50,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        trust_checkpoint_code: bool = False,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        start_method: StartMethod = "popen",
    ) -> None:
        if network is not None and not isinstance(network, NetworkModel):
            raise ValueError(f"network must be a NetworkModel, got {type(network).__name__}")
        if network is not None:
            check_static_membership(network)  # before any worker is launched
        if not isinstance(trust_checkpoint_code, bool):
            raise ValueError(f"trust_checkpoint_code must be True or False, got {trust_checkpoint_code!r}")
        _check_positive_number("gossip_timeout", gossip_timeout)
        collective_timeout = 2.0 * gossip_timeout if collective_timeout is None else collective_timeout
        _check_positive_number("collective_timeout", collective_timeout)
        if not isinstance(consensus_every, int) or consensus_every < 0:
            raise ValueError(f"consensus_every must be an int >= 0, got {consensus_every!r}")
        if not (cpu_threads in ("auto", None) or (isinstance(cpu_threads, int) and cpu_threads >= 1)):
            raise ValueError(f"cpu_threads must be 'auto', None or an int >= 1, got {cpu_threads!r}")
        if start_method == "fork" and isinstance(cpu_threads, int) and cpu_threads > 1:
            raise ValueError(
                f"cpu_threads={cpu_threads} with start_method='fork': OpenMP's thread pool does not survive a fork, "
                "so a forked worker runs with one torch thread. Use start_method='spawn' or 'popen' for more."
            )
        if worker_ddp_kwargs is not None and not isinstance(worker_ddp_kwargs, Mapping):
            raise ValueError(f"worker_ddp_kwargs must be a mapping of DDP arguments, got {worker_ddp_kwargs!r}")
        if worker_ddp_kwargs and ranks_per_worker == 1:
            raise ValueError("worker_ddp_kwargs applies inside a worker of several ranks: set ranks_per_worker > 1")
        if worker_ddp_kwargs and intra_worker == "fsdp":
            raise ValueError("worker_ddp_kwargs applies to intra_worker='ddp'; a sharded worker has no DDP wrapper")
        self._schedule = RoundSchedule(inner_steps, network, fastest_inner_steps)
        self._guard = NonFiniteGuard(on_nonfinite, max_skipped_rounds)
        self._workers = WorkerGroups(ranks_per_worker, intra_worker)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=None if checkpoint_io is None else resolve_checkpoint_io(checkpoint_io),  # None: Trainer plugins may set it
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=collective_timeout),
            start_method=start_method,
            **dict(worker_ddp_kwargs or {}),
        )
        self._network = network
        self._round_clock: RoundClock | None = None
        self._gossip_timeout = float(gossip_timeout)
        self._collective_timeout = float(collective_timeout)
        self._consensus_every = consensus_every
        self._bucket_cap_mb = float(bucket_cap_mb)
        self._cpu_threads = cpu_threads
        self._layout: FlatLayout | None = None
        self._transport: GossipTransport | None = None
        self._consensus: ConsensusSwap | None = None
        self._float_scratch: Tensor | None = None  # the average's buffer when messages are not float32
        self._round_start_buffers: Tensor | None = None  # exchanged buffers as the round started
        self._consensus_distance: float | None = None
        self._has_fit = False
        self._pending_rng: dict[str, Any] | None = None
        self._restored_per_rank_state = False
        self._trust_checkpoint_code = trust_checkpoint_code

    # ------------------------------------------------------------------ properties
    @property
    def inner_steps(self) -> int:
        """H_i, the optimizer steps this rank applies per round."""
        return self._schedule.inner_steps(self.global_rank)

    @property
    def round_length(self) -> int:
        """Steps of the training loop per round: max over ranks of H_i (identical on every rank)."""
        return self._schedule.round_length

    @property
    def round_index(self) -> int:
        """Rounds completed so far (the next round's index t)."""
        return self._schedule.round_index

    @property
    def steps_in_round(self) -> int:
        return self._schedule.steps_in_round

    @property
    def bytes_sent(self) -> int:
        return self._transport.counters.bytes_sent if self._transport else 0

    @property
    def bytes_received(self) -> int:
        return self._transport.counters.bytes_received if self._transport else 0

    @property
    def consensus_distance(self) -> float | None:
        """Last measured mean squared distance of the replicas to their average."""
        return self._consensus_distance

    @property
    def layout(self) -> FlatLayout:
        if self._layout is None:
            raise RuntimeError(f"{type(self).__name__} is not set up yet")
        return self._layout

    @property
    def sim_time(self) -> float | None:
        """This worker's simulated clock, in seconds (None without a network model)."""
        return self._round_clock.time if self._round_clock is not None else None

    @property
    def throttled_seconds(self) -> float:
        """Real seconds slept so far for the network's ``throttle`` (0 without one)."""
        return self._round_clock.throttled_seconds if self._round_clock is not None else 0.0

    @property
    def ranks_per_worker(self) -> int:
        return self._workers.ranks_per_worker

    @property
    def num_workers(self) -> int:
        """Workers that gossip: world size / ranks_per_worker."""
        return self._workers.num_workers(self.world_size)

    @property
    def worker_index(self) -> int:
        return self._workers.worker_of(self.global_rank)

    @property
    def is_worker_leader(self) -> bool:
        """Whether this rank is its worker's first rank (it exchanges for an unsharded worker)."""
        return self._workers.is_leader(self.global_rank)

    @property
    def intra_worker(self) -> str:
        """``"ddp"`` or ``"fsdp"``: how the ranks of one worker share its replica."""
        return self._workers.intra_worker

    @property
    def sharded(self) -> bool:
        """Whether each rank holds a shard of its worker's replica (``intra_worker="fsdp"``)."""
        return self._workers.sharded

    @property
    def shard_index(self) -> int:
        """The shard of its worker's replica this rank holds (0 when workers are not sharded)."""
        return self._workers.shard_of(self.global_rank)

    @property
    def exchanges_for_worker(self) -> bool:
        """Whether this rank exchanges with other workers: every rank of a sharded worker, else the leader."""
        return self._workers.exchanges(self.global_rank)

    @property
    def transport(self) -> GossipTransport:
        if self._transport is None:
            raise RuntimeError(f"{type(self).__name__} is not set up yet")
        return self._transport

    @property
    def skipped_rounds(self) -> int:
        """Rounds this worker discarded because its own point was not finite."""
        return self._guard.skipped_rounds

    @property
    def rejected_exchanges(self) -> int:
        """Messages from peers this worker rejected because they were not finite."""
        return self._guard.rejected_exchanges

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # The outer state exists only after setup: per-rank state is restored into it.
        return True

    @property
    def consensus_swapped_in(self) -> bool:
        return self._consensus is not None and self._consensus.swapped_in

    @property
    def message_dtype(self) -> torch.dtype:
        """The dtype of the points on the wire (float32 here; GASLoC may send bfloat16 or quantized bytes)."""
        return torch.float32

    def wire_format(self, numel: int) -> tuple[int, torch.dtype]:
        """``(elements, dtype)`` of one message of ``numel`` float32 elements on the wire."""
        return numel, torch.float32

    # ------------------------------------------------------------------ set-up
    @override
    def _configure_launcher(self) -> None:
        # The world size is known here, in the main process, before any worker is launched:
        # configuration errors surface at Trainer(...) instead of inside every child.
        self.check_configuration(self.num_nodes * self.num_processes)
        super()._configure_launcher()
        if self.sharded and self._start_method in ("spawn", "fork", "forkserver"):  # Lightning's multiprocessing ones
            self._launcher = ShardedResultsLauncher(self, start_method=self._start_method)
        if self._start_method == "popen":
            self._launcher = StoppingSubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def check_configuration(self, world_size: int) -> None:
        """Refuse configurations that cannot work with ``world_size`` ranks."""
        self._workers.check_world_size(world_size)
        if self._network is not None:
            self._network.check_world_size(self._workers.num_workers(world_size))
        self._schedule.resolve(world_size, self._workers.ranks_per_worker)

    @override
    def setup_environment(self) -> None:
        exit_with_parent()
        if self._start_method == "fork" and self.root_device.type == "cpu" and self.num_processes > 1:
            # The parent's OpenMP pool is gone in a forked child: a parallel region with more than one
            # thread would wait for it forever. Lightning's own thread setting is skipped whenever
            # OMP_NUM_THREADS is set, so it cannot be relied on here.
            torch.set_num_threads(1)
        elif self._cpu_threads == "auto":
            _set_num_threads_if_needed(self.num_processes)  # what Lightning's launchers do; no-op if done
        elif self._cpu_threads is not None and self.root_device.type == "cpu":
            torch.set_num_threads(self._cpu_threads)
        super().setup_environment()
        if self.sharded:
            # As Lightning's ModelParallelStrategy: the mesh exists before configure_model, which shards over it.
            mesh = self._workers.create_mesh(self.world_size, self.root_device.type)
            self.lightning_module._device_mesh = mesh

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self._layer_sync is not None:
            raise ValueError(
                f"{type(self).__name__} does not support sync_batchnorm=True: replicas differ by design and "
                "BatchNorm statistics are mixed by gossip instead. Remove sync_batchnorm from the Trainer."
            )
        fitting = trainer.state.fn == TrainerFn.FITTING
        replicas = self._keep_replicas_through_setup(fitting)
        if self.sharded and not fitting:
            self._setup_sharded_for_evaluation(trainer)
        else:
            super().setup(trainer)  # DDPStrategy's: configure_ddp (below) when fitting, else rank 0's weights
        if not fitting:
            self._build_layout()
            if replicas is not None:  # evaluating after a fit: the replicas stay as fit left them
                self.layout.scatter(replicas.to(self.layout.device))
        if fitting:
            self._check_optimizers()
            self._schedule.reset()
            self._init_outer_state()
            self._remember_round_start_buffers()
            move_sigterm_check(trainer, lambda: self._schedule.at_round_start)
            self._start_clock()
            self._has_fit = True
        self._attach_callback(trainer)

    def _setup_sharded_for_evaluation(self, trainer: pl.Trainer) -> None:
        """DDPStrategy's setup outside fit, less its broadcast of rank 0's module states: rank 0 holds one shard,
        and every rank sharded the same weights already (the launching process's model)."""
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.setup_precision_plugin()

    def _keep_replicas_through_setup(self, fitting: bool) -> Tensor | None:
        """DDPStrategy's setup gives every rank rank 0's weights when not fitting: right for a fresh model,
        wrong after a fit that kept distinct replicas. Returns a copy to restore in that case."""
        if fitting or not self._has_fit or self._layout is None:
            return None
        return self._layout.gather(torch.empty(self._layout.numel, dtype=torch.float32))

    @override
    def configure_ddp(self) -> None:
        """No DDP wrapper between workers (no gradient all-reduce); inside a worker of several ranks, DDP, or
        nothing when the module sharded itself with FSDP2 (its own reduce-scatter runs inside the worker)."""
        if self.sharded:
            self._check_sharded_module()
        self._build_layout()
        self._broadcast_initial_weights()
        if self.sharded:
            return
        if self._workers.create(self.world_size, self.global_rank) is not None:
            self._ddp_kwargs["process_group"] = self._workers.group
            super().configure_ddp()

    def _check_sharded_module(self) -> None:
        sharded_state.check_sharded_module(self.lightning_module, self._workers.mesh["shards"])

    def _build_layout(self) -> None:
        self._layout = FlatLayout(self.lightning_module)
        numel, dtype = self.wire_format(self._layout.numel)
        self._transport = GossipTransport(  # a sharded worker's rank exchanges with the same shard of other workers
            numel, self.root_device, self._gossip_timeout, self._bucket_cap_mb, group=self._workers.shard_peers_group,
            dtype=dtype,
        )
        self._consensus = ConsensusSwap(self._layout, self._replica_mean, self._drain_for_consensus)
        self._check_same_model_on_every_rank()

    def _check_same_model_on_every_rank(self) -> None:
        """Ranks compare a hash of their exchanged tensors' names, shapes and dtypes (integers in a tensor:
        no rank unpickles another's bytes)."""
        if self.world_size <= 1:
            return
        digest = [self.layout.signature_digest(), self.layout.numel]
        mine = torch.tensor(digest, dtype=torch.int64, device=self.root_device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        for rank, other in enumerate(every):  # the same shard of worker 0 holds as many elements
            if not torch.equal(other, every[self._workers.peer_rank(0, rank)]):
                raise RuntimeError(
                    f"rank {rank} holds a different model than rank 0 (the names, shapes or dtypes of the exchanged "
                    f"tensors differ: {int(other[1])} against {int(every[0][1])} elements); every rank must build "
                    "the same architecture before any exchange"
                )

    def _broadcast_initial_weights(self) -> None:
        """All replicas start from rank 0's weights: one broadcast of the flat vector."""
        if self.world_size <= 1:
            return
        flat = self.layout.read()
        dist.broadcast(flat, src=self._workers.peer_rank(0, self.global_rank), group=self._workers.shard_peers_group)
        self.layout.scatter(flat)

    def broadcast_in_worker(self, *tensors: Tensor) -> None:
        """Copy the worker leader's tensors to the other ranks of its worker (no-op with one rank per worker)."""
        self._workers.broadcast(self.global_rank, *tensors)

    def check_loader_lengths(self, train_batches: float, val_batches: float) -> None:
        """Every rank must see the same number of training and validation batches (a collective): with
        different lengths, one rank's validation or checkpoint collectives would meet another's gossip."""
        if self.world_size <= 1:
            return
        mine = torch.tensor([_finite_or_minus_one(train_batches), _finite_or_minus_one(val_batches)],
                            dtype=torch.float64, device=self.root_device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        lengths = [tuple(int(v) for v in lengths.tolist()) for lengths in every]
        if len(set(lengths)) > 1:
            table = ", ".join(f"rank {r}: {t} train / {v} val" for r, (t, v) in enumerate(lengths))
            raise ValueError(
                f"the ranks' dataloaders have different lengths ({table}; -1 is unbounded): every rank must take "
                "the same number of batches per epoch, or its collectives interleave with its peers' gossip. Use "
                "the same number of samples per rank (e.g. drop_last), or limit_train_batches / limit_val_batches."
            )

    def _check_optimizers(self) -> None:
        if len(self.optimizers) != 1:
            raise ValueError(
                f"{type(self).__name__} supports exactly one optimizer (automatic or manual optimization); "
                f"configure_optimizers returned {len(self.optimizers)}"
            )

    def _attach_callback(self, trainer: pl.Trainer) -> None:
        callback_type = self.round_callback_type()
        if callback_type is None or any(isinstance(cb, callback_type) for cb in trainer.callbacks):
            return
        # Before checkpoint callbacks: the local replicas must be back in place when they save.
        position = next((i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, Checkpoint)), None)
        trainer.callbacks.insert(len(trainer.callbacks) if position is None else position, callback_type())

    @classmethod
    def round_callback_type(cls) -> type[pl.Callback] | None:
        """The callback that logs rounds and evaluates the consensus, added when the user has none
        (registered by :mod:`gasloc_lightning.strategies.callbacks`, which sits above this module)."""
        return _round_callback[0]

    def _init_outer_state(self) -> None:
        """Create the per-worker outer state from the (now identical) live parameters."""

    def _start_clock(self) -> None:
        self._round_clock = None
        if self._network is not None:  # a sharded worker's k ranks exchange over k links at once
            self._round_clock = RoundClock(self._network, worker=self.worker_index, device=self.root_device,
                                           links=self.ranks_per_worker if self.sharded else 1)

    def _clock_all_reduce(self, element_size: float | None = None) -> None:
        """An all-reduce round in simulated time (a collective when there is a clock); ``element_size``: bytes
        per element on the wire when the all-reduce is quantized."""
        if self._round_clock is not None:
            self._round_clock.on_all_reduce(element_size=element_size)

    def _clock_tensor(self) -> Tensor:
        if self._round_clock is not None:
            return self._round_clock.tensor()
        return torch.zeros(1, dtype=torch.float64, device=self.root_device)

    def _drain_exchanges(self) -> None:
        """Hook: finish any exchange still in flight before the message or receive buffers are reused."""

    def _flush_exchanges(self) -> None:
        """Hook: at the end of training, fold in whatever is still in flight."""

    def _drain_for_consensus(self) -> None:
        """Hook: what must land before the live points are averaged (a consensus measurement or evaluation):
        by default every exchange in flight."""
        self._drain_exchanges()

    # ------------------------------------------------------------------ the round
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if self._schedule.applies_step(self.global_rank):
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
            if self._round_clock is not None:
                self._round_clock.on_inner_step()
        else:  # this worker has done its H_i steps: compute (Lightning needs the closure run), do not apply
            output = closure()
        # Counted after the precision plugin, whether or not it skipped the update: rounds stay aligned.
        round_over = self._schedule.count_step()
        self._after_inner_step(self._schedule.steps_in_round)
        if round_over:
            self.end_round()
        return output

    def _after_inner_step(self, step_in_round: int) -> None:
        """Hook after inner step ``step_in_round`` (1 to H) of a round, before the round ends (streaming)."""

    def end_round(self) -> None:
        """Run the communication round now (every rank must call this at the same step)."""
        self._communicate()
        self._remember_round_start_buffers()
        if self._round_clock is not None:
            self._round_clock.on_round_end()
        self._schedule.finish_round()
        if self._consensus_every and self.round_index % self._consensus_every == 0:
            self._consensus_distance = self.measure_consensus_distance()

    def finish_pending_round(self) -> bool:
        """Run a final, shorter round if steps were taken since the last one, then fold in any exchange
        still in flight (end of training). Returns whether a final round ran."""
        ran = not self._schedule.at_round_start
        if ran:
            self.end_round()
        self._flush_exchanges()
        if self._round_clock is not None:
            self._round_clock.on_round_end()
        return ran

    def _communicate(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ bad points
    def _where(self) -> str:
        return f"rank {self.global_rank}, round {self.round_index}"

    def _guard_local_point(self, message: Tensor, round_start: Tensor) -> None:
        """Before sending: a non-finite local point never leaves this worker (see ``on_nonfinite``). The shards of
        one worker decide together, so a worker discards its round whole or not at all."""
        finite = self._workers.all_agree(all_finite(message), self.root_device)
        if self._guard.record_local_point(finite, self._where()):
            return
        params, buffers = self.layout.split(message)
        params.copy_(round_start)
        buffers.copy_(self._round_start_buffers)  # restored, never "repaired"
        self._zero_nonfinite_optimizer_state()

    def _remember_round_start_buffers(self) -> None:
        """Keep the exchanged buffers as a round starts: a discarded round restores them."""
        _, buffers = self.layout.split(self.layout.read())
        if self._round_start_buffers is None:
            self._round_start_buffers = torch.empty_like(buffers)
        self._round_start_buffers.copy_(buffers)

    def _zero_nonfinite_optimizer_state(self) -> None:
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, Tensor) and torch.is_floating_point(value):
                        torch.nan_to_num_(value, nan=0.0, posinf=0.0, neginf=0.0)

    def _accept(self, received: list[tuple[float, Tensor]], peers: list[int]) -> list[tuple[float, Tensor]]:
        """Drop non-finite messages: the worker keeps its own point for that peer's share this round."""
        return self._guard.accept(received, peers, self._where())

    # ------------------------------------------------------------------ consensus
    @torch.no_grad()
    def measure_consensus_distance(self) -> float:
        """Mean over workers of ||theta_i - mean(theta)||^2 over the trainable parameters (a collective)."""
        if self.world_size <= 1:
            return 0.0
        self._drain_for_consensus()
        params, _ = self.layout.split(self.layout.read())
        mean = self._replica_mean(params)
        distance = torch.sub(params, mean, out=mean).pow_(2).sum().reshape(1).double()
        dist.all_reduce(distance)  # a sharded worker's ranks add up its shards; a DDP worker's each hold it all
        return distance.item() / (self.num_workers if self.sharded else self.world_size)

    def _mean_buffer(self) -> Tensor:
        """Float32 model-size scratch for the replicas' average: the first receive buffer when messages
        are float32 (free outside a round), else a buffer of its own (averaging in bfloat16 would round)."""
        buffer = self.transport.receive_buffer(0)
        if buffer.dtype == torch.float32:
            return buffer
        if self._float_scratch is None:
            self._float_scratch = self.layout.new_buffer()
        return self._float_scratch

    def _replica_mean(self, flat: Tensor) -> Tensor:
        """The average of ``flat`` over every rank (a collective), in the mean buffer."""
        mean = self._mean_buffer()[: flat.numel()]
        mean.copy_(flat)
        if self.world_size > 1:  # over the ranks holding the same part (all of them, or the same shard)
            group = self._workers.shard_peers_group
            dist.all_reduce(mean, group=group)
            mean.div_(dist.get_world_size(group))
        return mean

    def swap_in_consensus(self) -> None:
        """Replace every replica by the average of all replicas (a collective); ``restore_local`` undoes it."""
        self._consensus.swap_in()

    def show_local(self) -> None:
        """While the consensus is swapped in: put the local replica back temporarily (no communication)."""
        self._consensus.show_local()

    def show_consensus(self) -> None:
        """Undo ``show_local``."""
        self._consensus.show_consensus()

    def restore_local(self) -> None:
        if self._consensus is not None:
            self._consensus.restore()

    def average_replicas(self) -> None:
        """Make every replica the consensus model for good (end of fit)."""
        self._consensus.make_permanent()
        self._on_replicas_averaged()

    def _on_replicas_averaged(self) -> None:
        """Hook: keep the outer state consistent with the averaged live parameters."""

    # ------------------------------------------------------------------ state
    def strategy_state_dict(self) -> dict[str, Any]:
        """Everything the strategy needs to resume this rank exactly."""
        counters = self._transport.counters.state_dict() if self._transport else {}
        return {
            **self._schedule.state_dict(),
            **self._guard.state_dict(),
            "counters": counters,
            "consensus_distance": self._consensus_distance,
            "round_start_buffers": None if self._round_start_buffers is None else self._round_start_buffers.clone(),
            "clock": self._round_clock.state_dict() if self._round_clock is not None else None,
        }

    def load_strategy_state_dict(self, state: dict[str, Any]) -> None:
        self._schedule.load_state_dict(state)
        self._guard.load_state_dict(state)
        self._consensus_distance = state.get("consensus_distance")
        if state.get("round_start_buffers") is not None and self._round_start_buffers is not None:
            self._round_start_buffers.copy_(state["round_start_buffers"])
        if self._round_clock is not None and state.get("clock") is not None:
            self._round_clock.load_state_dict(state["clock"])
        if self._transport and state.get("counters"):
            self._transport.counters.load_state_dict(state["counters"])

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.consensus_swapped_in:
            raise RuntimeError(
                "a checkpoint was requested while the consensus model is swapped in for evaluation; "
                "checkpoints must hold the local replicas (is a checkpoint callback ordered before GASLoCCallback?)"
            )
        state = super().lightning_module_state_dict()
        return sharded_state.local_module_state(state)[0] if self.sharded else state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.sharded:  # this rank's shard of the optimizer state, as plain tensors
            return sharded_state.local_optimizer_state(optimizer)
        return super().optimizer_state(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self.sharded:
            super().load_optimizer_state_dict(checkpoint)
            return
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(sharded_state.sharded_optimizer_state(optimizer, state))

    def full_state_dict(self) -> dict[str, Any]:
        """The LightningModule's whole state dict on every rank (a sharded worker gathers its shards: a collective
        inside each worker)."""
        if self.sharded:
            return sharded_state.full_module_state(self.lightning_module)
        return self.lightning_module.state_dict()

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """A :class:`~gasloc_lightning.plugins.per_rank_io.PerRankCheckpointIO`, possibly wrapped (``AsyncCheckpointIO``)."""
        self._checkpoint_io = resolve_checkpoint_io(self._checkpoint_io)
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = resolve_checkpoint_io(io)  # Trainer(plugins=[...]) sets it here

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Every rank writes its own file of a per-rank checkpoint directory through ``checkpoint_io``."""
        self._drain_exchanges()
        # Rank 0's random id marks this save's files, so a reader can tell a complete directory.
        save_id = torch.tensor([secrets.randbits(62) if self.is_global_zero else 0], device=self.root_device)
        if dist.is_initialized():
            dist.broadcast(save_id, src=0)
        checkpoint = dict(checkpoint)
        checkpoint["gasloc"] = {"rank": self.global_rank, "world_size": self.world_size, "save_id": int(save_id),
                                "strategy": self.strategy_state_dict(), "rng": ckpt.rng_state_dict()}
        if self.sharded:  # what gasloc-export needs to put the worker's shards together
            names = sharded_state.local_module_state(self.lightning_module.state_dict())[1]
            checkpoint["gasloc"]["shards"] = {"index": self.shard_index, "count": self.ranks_per_worker,
                                              "sharded": names}
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """A per-rank directory restores this rank's own state; a single-file checkpoint loads as usual.
        Either loads safely unless ``trust_checkpoint_code=True`` or ``weights_only=False``."""
        if self._trust_checkpoint_code:
            weights_only = False
        checkpoint = self.checkpoint_io.load_checkpoint(
            checkpoint_path, weights_only=weights_only, rank=self.global_rank, world_size=self.world_size
        )
        gasloc = checkpoint.pop("gasloc", None)
        self._restored_per_rank_state = gasloc is not None
        if gasloc is not None:
            self._check_saved_shards(checkpoint_path, gasloc.get("shards"))
            self.load_strategy_state_dict(gasloc["strategy"])
            self._pending_rng = gasloc["rng"]
        return checkpoint

    def _check_saved_shards(self, path: str | os.PathLike, shards: Any) -> None:
        """A per-rank checkpoint holds this rank's shard (intra_worker='fsdp') or its whole replica ('ddp'): it
        resumes only a run that lays the worker out the same way."""
        saved = "ddp" if shards is None else "fsdp"
        if saved != self.intra_worker:
            raise ckpt.CheckpointFormatError(
                f"checkpoint {path} was saved with intra_worker={saved!r}, this run has intra_worker="
                f"{self.intra_worker!r}: resume with intra_worker={saved!r}, or export the consensus (gasloc-export) "
                "and start a new run from it")
        if shards is not None and (not isinstance(shards, Mapping) or shards.get("count") != self.ranks_per_worker
                                   or shards.get("index") != self.shard_index):
            count = shards.get("count") if isinstance(shards, Mapping) else None
            raise ckpt.CheckpointFormatError(
                f"checkpoint {path} holds shards of workers of {count!r} ranks, this run has ranks_per_worker="
                f"{self.ranks_per_worker}: resume with the saved ranks_per_worker")

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.sharded and not self._restored_per_rank_state:
            raise ValueError("intra_worker='fsdp' resumes from a per-rank checkpoint of the same layout; to start a "
                             "sharded run from a single-file (consensus) checkpoint, load it into the model before fit")
        if self.sharded:
            sharded_state.load_local_module_state(self.lightning_module, checkpoint["state_dict"], strict=strict)
        else:
            super().load_model_state_dict(checkpoint, strict=strict)
        if not self._restored_per_rank_state and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            # A single-file checkpoint (e.g. a consensus export): every replica starts from it afresh.
            self._init_outer_state()

    @override
    def on_train_start(self) -> None:
        # RNG states are restored last, right before the first resumed step draws from them.
        if self._pending_rng is not None:
            ckpt.load_rng_state_dict(self._pending_rng)
            self._pending_rng = None

    @override
    def teardown(self) -> None:
        self.restore_local()
        if isinstance(self._launcher, ShardedResultsLauncher) and self._fit_finished_normally():
            self._launcher.keep(self.full_state_dict())  # before the process group is released below
        super().teardown()
        release_process_group()


    def _fit_finished_normally(self) -> bool:
        try:
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        except RuntimeError:  # spawn/fork's launching process tears down after a failed launch: no Trainer attached
            return False
        return (trainer is not None and trainer.state.fn == TrainerFn.FITTING
                and trainer.state.status == TrainerStatus.RUNNING and not trainer.interrupted)


_round_callback: list[type[pl.Callback] | None] = [None]


def use_round_callback(callback_type: type[pl.Callback]) -> None:
    """Set the callback every ``LocalStepsStrategy`` adds to a Trainer that has none of that type."""
    _round_callback[0] = callback_type


def _register_variants(strategy_registry: Any, cls: type, prefix: str, description: str) -> None:
    for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_notebook", "fork")):
        name = prefix + suffix
        if name not in strategy_registry:
            strategy_registry.register(
                name, cls, description=f"{description}, start_method={start_method!r}", start_method=start_method
            )


def _finite_or_minus_one(value: float) -> float:
    return float(value) if value != float("inf") else -1.0


def _check_positive_number(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
