"""The round machinery shared by GASLoC and DiLoCo: local steps, then a communication round.

``LocalStepsStrategy`` is a Lightning ``DDPStrategy`` without the DDP wrapper (so no gradient
all-reduce), with rank 0's initial weights broadcast once, a round every ``inner_steps`` (H)
real optimizer steps, traffic counters, the consensus (average) model for evaluation, per-rank
checkpoints, guards against non-finite points, workers made of several ranks, an optional
simulated clock, and a per-rank thread budget on CPU. Subclasses implement ``_communicate``.

Why rounds stay aligned: every rank counts the same optimizer steps (Lightning calls
``optimizer_step`` once per real step, also when a precision plugin skips the update), so every
rank enters round t at the same step, and every collective (ours and Lightning's) is reached by
all ranks in the same order.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from gasloc_lightning.plugins import per_rank as ckpt
from gasloc_lightning.network import NetworkModel, SimulatedClock, Throttle
from gasloc_lightning.comm.flat import FlatLayout, all_finite
from gasloc_lightning.comm.transport import GossipTransport

log = logging.getLogger(__name__)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class LocalStepsStrategy(DDPStrategy):
    """Base for strategies that train locally for H optimizer steps, then run a communication round.

    Args:
        inner_steps: H, optimizer steps between two rounds (>= 1), or one H_i per rank (the paper's
            heterogeneous workers): a round then lasts max(H_i) steps of the training loop on every rank,
            and a worker with a smaller H_i computes but does not apply its last max(H_i) - H_i steps
            (a slower worker does fewer updates in the same time), so rounds stay aligned.
        gossip_timeout: seconds any point-to-point wait may take before failing with the round and peers named.
        collective_timeout: seconds the process group's collectives may take (default 2 x gossip_timeout).
        consensus_every: every this many rounds, all ranks measure the consensus distance together (0: never).
        bucket_cap_mb: largest single message slice, in MiB.
        cpu_threads: torch threads per process on CPU; ``"auto"`` gives each local process its share of the cores.
        on_nonfinite: what a worker does when its own point is not finite at the end of a round:
            ``"skip_round"`` discards its local steps of that round (it restarts from its round-start point,
            non-finite entries of its optimizer state are zeroed) and still takes part in the exchange, so
            peers never wait and never receive it; ``"raise"`` stops at once.
        max_skipped_rounds: consecutive skipped rounds after which the worker stops with an error.
        ranks_per_worker: k ranks (e.g. the GPUs of one node) form one worker: they train as DDP among
            themselves (gradient all-reduce inside the worker) and gossip as one worker with the others
            (the worker's first rank exchanges, then broadcasts the result inside the worker).
        network: a :class:`~gasloc_lightning.network.NetworkModel` over the workers: every rank then keeps a
            simulated clock (compute from the modelled step time and speeds, communication from the modelled
            links and message size), logged as ``sim_time``. Training itself is unchanged.
        fastest_inner_steps: with ``inner_steps="auto"``, H of the fastest worker; the others get H_i in
            proportion to their speed in ``network`` (the paper's H_i), so rounds take equal time.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, start_method: as in Lightning's ``DDPStrategy``.
    """

    def __init__(
        self,
        *,
        inner_steps: int | Sequence[int] | Literal["auto"] = 50,
        gossip_timeout: float = 300.0,
        collective_timeout: float | None = None,
        consensus_every: int = 10,
        bucket_cap_mb: float = 64.0,
        cpu_threads: int | Literal["auto"] | None = "auto",
        on_nonfinite: Literal["skip_round", "raise"] = "skip_round",
        max_skipped_rounds: int = 3,
        ranks_per_worker: int = 1,
        network: NetworkModel | None = None,
        fastest_inner_steps: int = 50,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        start_method: StartMethod = "popen",
    ) -> None:
        if inner_steps == "auto" and network is None:
            raise ValueError("inner_steps='auto' needs a network model (network=NetworkModel(...)) for the speeds")
        if network is not None and not isinstance(network, NetworkModel):
            raise ValueError(f"network must be a NetworkModel, got {type(network).__name__}")
        _check_positive_int("fastest_inner_steps", fastest_inner_steps)
        for steps in [] if inner_steps == "auto" else [inner_steps] if isinstance(inner_steps, int) else inner_steps:
            _check_positive_int("inner_steps (H)", steps)
        _check_positive_number("gossip_timeout", gossip_timeout)
        collective_timeout = 2.0 * gossip_timeout if collective_timeout is None else collective_timeout
        _check_positive_number("collective_timeout", collective_timeout)
        if not isinstance(consensus_every, int) or consensus_every < 0:
            raise ValueError(f"consensus_every must be an int >= 0, got {consensus_every!r}")
        if not (cpu_threads in ("auto", None) or (isinstance(cpu_threads, int) and cpu_threads >= 1)):
            raise ValueError(f"cpu_threads must be 'auto', None or an int >= 1, got {cpu_threads!r}")
        if on_nonfinite not in ("skip_round", "raise"):
            raise ValueError(f"on_nonfinite must be 'skip_round' or 'raise', got {on_nonfinite!r}")
        _check_positive_int("max_skipped_rounds", max_skipped_rounds)
        _check_positive_int("ranks_per_worker", ranks_per_worker)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=collective_timeout),
            start_method=start_method,
        )
        self._inner_steps: int | list[int] | str = inner_steps if isinstance(inner_steps, (int, str)) else list(inner_steps)
        self._network = network
        self._fastest_inner_steps = fastest_inner_steps
        self._clock: SimulatedClock | None = None
        self._throttle: Throttle | None = None
        self._gossip_timeout = float(gossip_timeout)
        self._collective_timeout = float(collective_timeout)
        self._consensus_every = consensus_every
        self._bucket_cap_mb = float(bucket_cap_mb)
        self._cpu_threads = cpu_threads
        self._layout: FlatLayout | None = None
        self._transport: GossipTransport | None = None
        self._work: Tensor | None = None  # one flat model-size scratch vector, reused every round
        self._float_scratch: Tensor | None = None  # the average's buffer when messages are not float32
        self._round_index = 0
        self._steps_in_round = 0
        self._consensus_distance: float | None = None
        self._local_backup: Tensor | None = None  # local replica while the consensus model is swapped in
        self._on_nonfinite = on_nonfinite
        self._ranks_per_worker = ranks_per_worker
        self._worker_group: dist.ProcessGroup | None = None
        self._max_skipped_rounds = max_skipped_rounds
        self._consecutive_skips = 0
        self._skipped_rounds = 0
        self._rejected_exchanges = 0
        self._warned_peers: set[int] = set()
        self._pending_rng: dict[str, Any] | None = None
        self._restored_per_rank_state = False

    # ------------------------------------------------------------------ properties
    @property
    def inner_steps(self) -> int:
        """H_i, the optimizer steps this rank applies per round."""
        if isinstance(self._inner_steps, int):
            return self._inner_steps
        return self._inner_steps[self.global_rank]

    @property
    def round_length(self) -> int:
        """Steps of the training loop per round: max over ranks of H_i (identical on every rank)."""
        return self._inner_steps if isinstance(self._inner_steps, int) else max(self._inner_steps)

    def _check_inner_steps(self, world_size: int) -> None:
        if self._network is not None:
            self._network.check_world_size(world_size // self._ranks_per_worker)
        if self._inner_steps == "auto":  # one H_i per worker, repeated for each of its ranks
            per_worker = self._network.auto_inner_steps(self._fastest_inner_steps)
            self._inner_steps = [per_worker[rank // self._ranks_per_worker] for rank in range(world_size)]
        if not isinstance(self._inner_steps, int) and len(self._inner_steps) != world_size:
            raise ValueError(
                f"inner_steps has {len(self._inner_steps)} values (one H_i per rank) but the world size is {world_size}"
            )

    @property
    def round_index(self) -> int:
        """Rounds completed so far (the next round's index t)."""
        return self._round_index

    @property
    def steps_in_round(self) -> int:
        return self._steps_in_round

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
        return self._clock.time if self._clock is not None else None

    @property
    def throttled_seconds(self) -> float:
        """Real seconds slept so far for the network's ``throttle`` (0 without one)."""
        return self._throttle.slept if self._throttle is not None else 0.0

    @property
    def ranks_per_worker(self) -> int:
        return self._ranks_per_worker

    @property
    def num_workers(self) -> int:
        """Workers that gossip: world size / ranks_per_worker."""
        return self.world_size // self._ranks_per_worker

    @property
    def worker_index(self) -> int:
        return self.global_rank // self._ranks_per_worker

    @property
    def is_worker_leader(self) -> bool:
        """Whether this rank exchanges for its worker (the worker's first rank)."""
        return self.global_rank % self._ranks_per_worker == 0

    @property
    def transport(self) -> GossipTransport:
        if self._transport is None:
            raise RuntimeError(f"{type(self).__name__} is not set up yet")
        return self._transport

    @property
    def skipped_rounds(self) -> int:
        """Rounds this worker discarded because its own point was not finite."""
        return self._skipped_rounds

    @property
    def rejected_exchanges(self) -> int:
        """Messages from peers this worker rejected because they were not finite."""
        return self._rejected_exchanges

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # The outer state exists only after setup: per-rank state is restored into it.
        return True

    @property
    def consensus_swapped_in(self) -> bool:
        return self._local_backup is not None

    # ------------------------------------------------------------------ set-up
    @override
    def setup_environment(self) -> None:
        self._set_cpu_threads()
        super().setup_environment()

    def _set_cpu_threads(self) -> None:
        if self._cpu_threads is None or self.root_device.type != "cpu":
            return
        threads = self._cpu_threads
        if threads == "auto":
            threads = max(1, (os.cpu_count() or 1) // max(1, self.num_processes))
        torch.set_num_threads(threads)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self._layer_sync is not None:
            raise ValueError(
                f"{type(self).__name__} does not support sync_batchnorm=True: replicas differ by design and "
                "BatchNorm statistics are mixed by gossip instead. Remove sync_batchnorm from the Trainer."
            )
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._layout = FlatLayout(self.model)
        self._work = self._layout.new_buffer()
        self._transport = GossipTransport(
            self._layout.numel, self.root_device, self._gossip_timeout, self._bucket_cap_mb, group=None,
            dtype=self.message_dtype,
        )
        self._check_same_model_on_every_rank()
        if trainer.state.fn == TrainerFn.FITTING:
            self._broadcast_initial_weights()
            self._wrap_inside_worker()
            self.setup_optimizers(trainer)
            self._check_optimizers()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._round_index, self._steps_in_round = 0, 0
            self._init_outer_state()
            self._move_sigterm_check_to_round_boundaries(trainer)
            if self._network is not None:
                self._clock = SimulatedClock(self._network, rank=self.worker_index)
                self._throttle = Throttle(self._clock, self._network.throttle)
        self._attach_callback(trainer)

    def _move_sigterm_check_to_round_boundaries(self, trainer: pl.Trainer) -> None:
        """Lightning broadcasts a SIGTERM flag from rank 0 before every training step: a global
        collective that would make every worker wait for the slowest one at every step. We keep the
        check (all ranks still stop together on SIGTERM) but run it only when a round starts."""
        epoch_loop = trainer.fit_loop.epoch_loop
        original = getattr(epoch_loop, "_broadcast_sigterm_tensor", None)
        if original is None or getattr(original, "_gasloc_round_boundaries", False):
            return

        def sigterm_check_at_round_start() -> None:
            if self._steps_in_round == 0:
                original()

        sigterm_check_at_round_start._gasloc_round_boundaries = True  # type: ignore[attr-defined]
        epoch_loop._broadcast_sigterm_tensor = sigterm_check_at_round_start

    @override
    def configure_ddp(self) -> None:
        """No DDP wrapper: there is no gradient all-reduce between rounds."""

    def _check_same_model_on_every_rank(self) -> None:
        if self.world_size <= 1:
            return
        signature = self.layout.signature(self.lightning_module)
        signatures: list[Any] = [None] * self.world_size
        dist.all_gather_object(signatures, signature)
        for rank, other in enumerate(signatures):
            if other != signatures[0]:
                raise RuntimeError(
                    f"rank {rank} holds a different model than rank 0 (names, shapes or dtypes of the "
                    f"exchanged tensors differ: {_first_difference(signatures[0], other)}); every rank must "
                    "build the same architecture before any exchange"
                )

    def _broadcast_initial_weights(self) -> None:
        """All replicas start from rank 0's weights: one broadcast of the flat vector."""
        if self.world_size <= 1:
            return
        flat = self.layout.gather(self._work)
        dist.broadcast(flat, src=0)
        self.layout.scatter(flat)

    def _wrap_inside_worker(self) -> None:
        """With k ranks per worker: DDP (gradient all-reduce) inside each worker's process group."""
        if self._ranks_per_worker == 1:
            return
        k = self._ranks_per_worker
        # new_group is collective: every rank creates every worker's group, in the same order.
        for worker in range(self.num_workers):
            group = dist.new_group(list(range(worker * k, (worker + 1) * k)))
            if worker == self.worker_index:
                self._worker_group = group
        self._ddp_kwargs["process_group"] = self._worker_group
        super().configure_ddp()

    def broadcast_in_worker(self, *tensors: Tensor) -> None:
        """Copy the worker leader's tensors to the other ranks of its worker (no-op with one rank per worker)."""
        if self._worker_group is None:
            return
        leader = self.worker_index * self._ranks_per_worker
        for tensor in tensors:
            dist.broadcast(tensor, src=leader, group=self._worker_group)

    def _check_optimizers(self) -> None:
        if len(self.optimizers) != 1:
            raise ValueError(
                f"{type(self).__name__} supports exactly one optimizer (automatic or manual optimization); "
                f"configure_optimizers returned {len(self.optimizers)}"
            )

    def _attach_callback(self, trainer: pl.Trainer) -> None:
        from gasloc_lightning.strategies.callbacks import GASLoCCallback
        from lightning.pytorch.callbacks import Checkpoint

        if any(isinstance(cb, GASLoCCallback) for cb in trainer.callbacks):
            return
        # Before checkpoint callbacks: the local replicas must be back in place when they save.
        position = next((i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, Checkpoint)), None)
        trainer.callbacks.insert(len(trainer.callbacks) if position is None else position, GASLoCCallback())

    def _init_outer_state(self) -> None:
        """Create the per-worker outer state from the (now identical) live parameters."""

    @property
    def message_dtype(self) -> torch.dtype:
        """The dtype of the points on the wire (float32 here; GASLoC may send bfloat16)."""
        return torch.float32

    def _clock_all_reduce(self) -> None:
        """An all-reduce round in simulated time: it starts at the largest clock."""
        if self._clock is None:
            return
        latest = torch.tensor([self._clock.time], dtype=torch.float64, device=self.root_device)
        dist.all_reduce(latest, op=dist.ReduceOp.MAX)
        self._clock.all_reduce(max_clock=float(latest.item()))

    def _clock_tensor(self) -> Tensor:
        time = self._clock.time if self._clock is not None else 0.0
        return torch.tensor([time], dtype=torch.float64, device=self.root_device)

    def _drain_exchanges(self) -> None:
        """Hook: finish any exchange still in flight before the message or receive buffers are reused."""

    def _flush_exchanges(self) -> None:
        """Hook: at the end of training, fold in whatever is still in flight."""

    @override
    def _configure_launcher(self) -> None:
        # The world size is known here, in the main process, before any worker is launched:
        # configuration errors surface at Trainer(...) instead of inside every child.
        self.check_configuration(self.num_nodes * self.num_processes)
        super()._configure_launcher()

    def check_configuration(self, world_size: int) -> None:
        """Refuse configurations that cannot work with ``world_size`` ranks."""
        self._check_inner_steps(world_size)
        if world_size % self._ranks_per_worker:
            raise ValueError(
                f"{world_size} ranks are not divisible by ranks_per_worker={self._ranks_per_worker}: every worker "
                "needs the same number of ranks"
            )

    # ------------------------------------------------------------------ the round
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if self._steps_in_round < self.inner_steps:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
            if self._clock is not None:
                self._clock.advance_compute(1)
        else:  # this worker has done its H_i steps: compute (Lightning needs the closure run), do not apply
            output = closure()
        # Counted after the precision plugin, whether or not it skipped the update: rounds stay aligned.
        self._steps_in_round += 1
        if self._steps_in_round >= self.round_length:
            self.end_round()
        return output

    def end_round(self) -> None:
        """Run the communication round now (every rank must call this at the same step)."""
        self._communicate()
        if self._throttle is not None:
            self._throttle()
        self._round_index += 1
        self._steps_in_round = 0
        if self._consensus_every and self._round_index % self._consensus_every == 0:
            self._consensus_distance = self.measure_consensus_distance()

    def finish_pending_round(self) -> bool:
        """Run a final, shorter round if steps were taken since the last one, then fold in any exchange
        still in flight (end of training). Returns whether a final round ran."""
        ran = self._steps_in_round > 0
        if ran:
            self.end_round()
        self._flush_exchanges()
        if self._throttle is not None:
            self._throttle()
        return ran

    def _communicate(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ bad points
    def _guard_local_point(self, message: Tensor, round_start: Tensor) -> None:
        """Before sending: a non-finite local point never leaves this worker (see ``on_nonfinite``)."""
        if all_finite(message):
            self._consecutive_skips = 0
            return
        where = f"rank {self.global_rank}, round {self._round_index}"
        if self._on_nonfinite == "raise":
            raise FloatingPointError(f"{where}: the local parameters are not finite (on_nonfinite='raise')")
        self._consecutive_skips += 1
        self._skipped_rounds += 1
        if self._consecutive_skips > self._max_skipped_rounds:
            raise FloatingPointError(
                f"{where}: the local parameters were not finite for {self._consecutive_skips} consecutive rounds "
                f"(max_skipped_rounds={self._max_skipped_rounds}); lower the learning rate or check the data"
            )
        log.warning("%s: non-finite local parameters, round discarded (restarting from the round start)", where)
        params, buffers = self.layout.split(message)
        params.copy_(round_start)
        torch.nan_to_num_(buffers, nan=0.0, posinf=0.0, neginf=0.0)
        self._zero_nonfinite_optimizer_state()

    def _zero_nonfinite_optimizer_state(self) -> None:
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, Tensor) and torch.is_floating_point(value):
                        torch.nan_to_num_(value, nan=0.0, posinf=0.0, neginf=0.0)

    def _accept(self, received: list[tuple[float, Tensor]], peers: list[int]) -> list[tuple[float, Tensor]]:
        """Drop non-finite messages: the worker keeps its own point for that peer's share this round."""
        accepted = []
        for (weight, message), peer in zip(received, peers):
            if all_finite(message):
                accepted.append((weight, message))
                continue
            self._rejected_exchanges += 1
            if peer not in self._warned_peers:
                self._warned_peers.add(peer)
                log.warning(
                    "rank %d: rejected a non-finite message from peer %d in round %d (kept its own point for that "
                    "share; the replicas' mean moves this round); further rejections are counted in "
                    "comm/rejected_exchanges", self.global_rank, peer, self._round_index,
                )
        return accepted

    # ------------------------------------------------------------------ consensus
    @torch.no_grad()
    def measure_consensus_distance(self) -> float:
        """Mean over workers of ||theta_i - mean(theta)||^2 over the trainable parameters (a collective)."""
        if self.world_size <= 1:
            return 0.0
        self._drain_exchanges()
        params, _ = self.layout.split(self.layout.gather(self._work))
        mean = self._replica_mean(params)
        distance = torch.sub(params, mean, out=mean).pow_(2).sum().reshape(1).double()
        dist.all_reduce(distance)
        return distance.item() / self.world_size

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
        dist.all_reduce(mean)
        return mean.div_(self.world_size)

    @torch.no_grad()
    def swap_in_consensus(self) -> None:
        """Replace every replica by the average of all replicas (a collective); ``restore_local`` undoes it."""
        if self._local_backup is not None:
            return
        self._drain_exchanges()
        self._local_backup = self.layout.gather(self._work)
        if self.world_size > 1:
            self.layout.scatter(self._replica_mean(self._local_backup))

    @torch.no_grad()
    def show_local(self) -> None:
        """While the consensus is swapped in: put the local replica back temporarily (no communication)."""
        if self._local_backup is not None:
            self.layout.scatter(self._local_backup)

    @torch.no_grad()
    def show_consensus(self) -> None:
        """Undo ``show_local`` (the average is still in its buffer)."""
        if self._local_backup is not None and self.world_size > 1:
            self.layout.scatter(self._mean_buffer())

    @torch.no_grad()
    def restore_local(self) -> None:
        if self._local_backup is not None:
            self.layout.scatter(self._local_backup)
            self._local_backup = None

    @torch.no_grad()
    def average_replicas(self) -> None:
        """Make every replica the consensus model for good (end of fit)."""
        self.restore_local()
        self.swap_in_consensus()
        self._local_backup = None
        self._on_replicas_averaged()

    def _on_replicas_averaged(self) -> None:
        """Hook: keep the outer state consistent with the averaged live parameters."""

    # ------------------------------------------------------------------ state
    def strategy_state_dict(self) -> dict[str, Any]:
        """Everything the strategy needs to resume this rank exactly."""
        counters = self._transport.counters.state_dict() if self._transport else {}
        return {
            "round_index": self._round_index,
            "steps_in_round": self._steps_in_round,
            "counters": counters,
            "consensus_distance": self._consensus_distance,
            "skipped_rounds": self._skipped_rounds,
            "consecutive_skips": self._consecutive_skips,
            "rejected_exchanges": self._rejected_exchanges,
            "clock": self._clock.state_dict() if self._clock is not None else None,
        }

    def load_strategy_state_dict(self, state: dict[str, Any]) -> None:
        self._round_index = int(state["round_index"])
        self._steps_in_round = int(state["steps_in_round"])
        self._consensus_distance = state.get("consensus_distance")
        self._skipped_rounds = int(state.get("skipped_rounds", 0))
        self._consecutive_skips = int(state.get("consecutive_skips", 0))
        self._rejected_exchanges = int(state.get("rejected_exchanges", 0))
        if self._clock is not None and state.get("clock") is not None:
            self._clock.load_state_dict(state["clock"])
            self._throttle = Throttle(self._clock, self._network.throttle)  # sleep only for what follows
        if self._transport and state.get("counters"):
            self._transport.counters.load_state_dict(state["counters"])

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.consensus_swapped_in:
            raise RuntimeError(
                "a checkpoint was requested while the consensus model is swapped in for evaluation; "
                "checkpoints must hold the local replicas (is a checkpoint callback ordered before GASLoCCallback?)"
            )
        return super().lightning_module_state_dict()

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Every rank writes its own file of a checkpoint directory; rank 0 adds the shared part and, last, meta.json."""
        directory = Path(filepath)
        if self.is_global_zero:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / ckpt.META_FILE).unlink(missing_ok=True)  # incomplete until rewritten below
        self.barrier("gasloc.save_checkpoint.start")
        directory.mkdir(parents=True, exist_ok=True)  # per-node disks: every node makes its own
        self._drain_exchanges()
        checkpoint = dict(checkpoint)
        checkpoint["gasloc"] = {"strategy": self.strategy_state_dict(), "rng": ckpt.capture_rng_states()}
        shared, own = ckpt.split_checkpoint(checkpoint)
        ckpt.atomic_save(own, ckpt.rank_file(directory, self.global_rank))
        if self.is_global_zero:
            ckpt.atomic_save(shared, directory / ckpt.SHARED_FILE)
        self.barrier("gasloc.save_checkpoint.written")
        if self.is_global_zero:
            ckpt.write_meta(directory, self.world_size, int(checkpoint.get("global_step", 0)))

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """A per-rank directory restores this rank's own state; a single-file checkpoint loads as usual."""
        if not ckpt.is_per_rank_checkpoint(checkpoint_path):
            self._restored_per_rank_state = False
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        checkpoint = ckpt.load_rank_checkpoint(checkpoint_path, self.global_rank, self.world_size)
        gasloc = checkpoint.pop("gasloc")
        self.load_strategy_state_dict(gasloc["strategy"])
        self._pending_rng = gasloc["rng"]
        self._restored_per_rank_state = True
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        if not self._restored_per_rank_state and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            # A single-file checkpoint (e.g. a consensus export): every replica starts from it afresh.
            self._init_outer_state()

    @override
    def on_train_start(self) -> None:
        # RNG states are restored last, right before the first resumed step draws from them.
        if self._pending_rng is not None:
            ckpt.restore_rng_states(self._pending_rng)
            self._pending_rng = None

    @override
    def teardown(self) -> None:
        self._local_backup = None
        super().teardown()
        if multiprocessing.parent_process() is not None and dist.is_initialized():
            # A spawned or forked worker exits right after this. Left to the interpreter's shutdown,
            # the gloo process group was seen to abort a worker ("terminate called without an active
            # exception") once in a CI run; destroying it here is local, so it cannot hang.
            dist.destroy_process_group()


def _register_variants(strategy_registry: Any, cls: type, prefix: str, description: str) -> None:
    for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_notebook", "fork")):
        name = prefix + suffix
        if name not in strategy_registry:
            strategy_registry.register(
                name, cls, description=f"{description}, start_method={start_method!r}", start_method=start_method
            )


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _check_positive_number(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


def _first_difference(expected: list, actual: list) -> str:
    for a, b in zip(expected, actual):
        if a != b:
            return f"rank 0 has {a}, the other has {b}"
    return f"rank 0 has {len(expected)} tensors, the other has {len(actual)}"
