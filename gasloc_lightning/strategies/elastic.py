"""Elastic GASLoC: workers that come and go, over torchft's lighthouse, quorum and checkpoint transport.

Each worker is its own launch (one process here: Lightning's world is that worker's ranks) and finds
the others through a torchft lighthouse (:mod:`gasloc_lightning.comm.membership`). A round is:

1. H local steps (unchanged: :class:`~gasloc_lightning.strategies.local_steps.LocalStepsStrategy`);
2. the gossip exchange with this round's peers, drawn from the round's quorum: the topology's graph
   for n = quorum size at round t, whose node i is the i-th of the sorted member ids. Every member
   derives the same matching from (seed, t, sorted ids) without a message;
3. the commit (a failed exchange is reported only now, after the round's collectives).

The quorum of the next round forms at the next *boundary* where every member does the same thing: the
consensus validation that follows the round (if Lightning validates at that step), else the first step of
the next round, else the end-of-fit average. A new, restarted or lagging worker receives in it the state of
one live peer (live point, outer state, inner optimizer and LR-scheduler state, round index, and where the
peer is: its boundary, its global step, whether its fit ends there), performs the collectives the peer is
about to perform (a joiner at a validation boundary takes part in its replica average), and continues at
the quorum's round with its own data shard (its data loader goes on from where it stands: a restarted
worker starts its shard's sampler afresh).
Forming the quorum only at the boundary means the members of a consensus validation are exactly those
that validate, and a worker that died in the round is already out of it.

On failure: a peer that died (the exchange fails at once) or hung (after ``gossip_timeout``) leaves this
worker with its own point for that peer's share, counted in ``comm/failed_exchanges``; the lighthouse
drops the dead worker from the next quorum after its heartbeat timeout. A joiner whose model signature
or hyperparameters differ from its peer's refuses itself with :class:`ElasticJoinError`; the running
workers lose at most that round's share with it. Consensus evaluation and the end-of-fit average are
all-reduces over the live quorum (a failed one evaluates the local replica instead).

A worker that gets SIGTERM (a spot preemption notice, or ``gasloc-elastic`` stopping) *leaves*: it finishes
its current round (exchange included) and commits it, stops heartbeating (the next quorum forms without it, so
no peer records a failed exchange), skips the end-of-fit average and ends its fit with its own replica, which the
app checkpoints. A signal that falls while the worker waits for a quorum lets that quorum form and the worker
trains its round; if none forms within ``quorum_timeout`` or ``leave_grace_s`` (the others left too), it leaves
with its last committed round and its checkpoint. A round still running ``leave_grace_s`` after the signal is
abandoned at once (:class:`ElasticLeave`, no checkpoint).

A peer's state is taken only from members that know the run's secret, is loaded without unpickling
(:mod:`gasloc_lightning.comm.wire`), and is checked against this worker's own (names, shapes, dtypes, finite
values) before it replaces anything.

Elastic DiLoCo is the same engine with ``topology="complete"`` (an all-reduce over the quorum; exactly
DiLoCo's outer Nesterov step, see ``docs/algorithm.md`` section 2): :class:`ElasticDiLoCoStrategy`.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import Callback, Timer
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from gasloc_lightning.algorithm.round import GossipRound, check_codec
from gasloc_lightning.comm.elastic_encoded_mean import QuantizedRoundMean
from gasloc_lightning.comm.elastic_transport import ElasticCollectiveError, ElasticTransport
from gasloc_lightning.comm.endpoints import Endpoint
from gasloc_lightning.comm.faults import FaultPoints
from gasloc_lightning.comm.flat import all_finite
from gasloc_lightning.comm.lineage import Lineage, LineageExchangeError, LineageTracker
from gasloc_lightning.comm.member_auth import MemberAuthenticator
from gasloc_lightning.comm.membership import ElasticMembership, MembershipError, Quorum, SurplusWorkerError
from gasloc_lightning.comm.message_auth import MessageAuthenticator
from gasloc_lightning.comm.quorum_floor import SplitQuorumWarning, is_split_quorum, quorum_floor, split_warning
from gasloc_lightning.comm.run_end import is_final
from gasloc_lightning.comm.state_apply import StateApplyError, StatePart, apply_all_or_nothing
from gasloc_lightning.comm.wire import (MIN_SECRET_BYTES, UnsafePayloadError, check_like, check_plain,
                                        run_secret)
from gasloc_lightning.strategies.callbacks import GASLoCCallback
from gasloc_lightning.strategies.final_average import FAULT_POINTS, FinalAverage
from gasloc_lightning.strategies.gasloc import GASLoCStrategy
from gasloc_lightning.strategies.local_steps import LocalStepsStrategy

log = logging.getLogger(__name__)

__all__ = ["ElasticDiLoCoStrategy", "ElasticGASLoCStrategy", "ElasticJoinError", "ElasticLeave",
           "ElasticMetricsCallback"]

# message_auth=None tags messages up to this many float32 elements (64 MB): benchmarks/message_auth.py measured the
# tags at 1.004-1.007x a demo round, but 4.2x the exchange of a 1B-parameter message on a 2-core host.
AUTO_MESSAGE_AUTH_ELEMENTS = 1 << 24

# Where a member is when the next quorum forms (sent to joiners with the state, so they do what it does next).
_START, _TRAIN, _VALIDATE, _AVERAGE = "start", "train", "validate", "average"


class ElasticJoinError(RuntimeError):
    """A joining worker's model or hyperparameters differ from the running workers', or a peer's state is unsafe."""


class ElasticLeave(BaseException):
    """SIGTERM made this worker abandon its round (its grace ran out, or it was waiting for a quorum).

    A ``BaseException``, like ``KeyboardInterrupt``: no ``except Exception`` on the way (torchft's, the quorum
    retries) may take it for a failure to retry."""


class ElasticGASLoCStrategy(GASLoCStrategy):
    """GASLoC over a live quorum of workers that may die, stall, join and rejoin (torchft membership).

    Cagnasso, Belilovsky, Oyallon, arXiv 2606.11081, with elastic membership from torchft. What
    happens on failure is in the module docstring and ``docs/elastic.md``.

    Args:
        lighthouse: ``HOST:PORT`` of the torchft lighthouse every worker registers with.
        worker_id: this worker's number (its member name is ``worker_<id>``; a restarted worker keeps it).
        min_workers: the smallest quorum a round runs in (the lighthouse's ``--min_replicas``); ``None``: a majority
            of ``max_workers``, so that two sides of a partition never both train
            (:mod:`~gasloc_lightning.comm.quorum_floor`). A smaller one needs ``allow_split_quorum``.
        max_workers: the largest quorum the run allows; gamma must be stable for every size in
            [max(2, min_workers), max_workers] (checked at construction).
        allow_split_quorum: accept a ``min_workers`` below a majority of ``max_workers`` (a run that must go on
            with fewer survivors); it warns (:class:`~gasloc_lightning.comm.quorum_floor.SplitQuorumWarning`): a
            partition can then leave two sides training apart, and the run ending on two models.
        connect_timeout: seconds to reach the lighthouse (then a clear error).
        quorum_timeout: seconds a round waits for a quorum of ``min_workers`` (then a clear error). Must
            exceed the time of one round and a validation, since a joiner waits for the others to finish theirs.
        transfer_timeout: seconds a state transfer to a joining worker may take.
        heartbeat_interval: seconds between this worker's heartbeats to the lighthouse.
        first_quorum_delay: seconds between registering with the lighthouse and asking for the first quorum, for
            workers started together, so that all make the first one (``gasloc-elastic`` gives its first workers
            ``elastic.first_quorum_delay``); 0 for a restarted or added worker, which the next quorum takes in.
        gossip_timeout: seconds a send, receive or all-reduce may take before the peer counts as failed. Must
            exceed the time a joiner takes to receive and load a peer's state (the first collective after a
            join waits for it).
        outer_momentum: gamma; ``None`` takes the smallest topology default over the allowed quorum sizes.
        bind: the local address every service of this worker listens on (default 127.0.0.1: nothing is reachable
            from another machine). Several machines: this machine's address on the private network.
        advertise: the address peers use to reach this worker (default: ``bind``).
        secret: the run's secret, shared by every worker; ``None`` reads the environment variable
            ``GASLOC_ELASTIC_SECRET`` (``gasloc-elastic`` sets it). Never logged.
        leave_grace_s: seconds after SIGTERM within which this worker finishes its round before it leaves; past
            them it abandons the round.
        lighthouse_timeout: seconds one request to the lighthouse may wait before it is asked again.
        lighthouse_wait: seconds a worker waits for a lighthouse that died to come back on the same address (then a
            clear error); see :class:`~gasloc_lightning.comm.membership.ElasticMembership`.
        member_auth: before a quorum's first exchange, its members prove they know the run's secret and agree on
            one admitted set (``comm/member_auth.py``); none outside it is sent or read anything
            (``docs/security.md``: what it protects and costs).
        message_auth: tag every gossip message and all-reduce chunk with a keyed hash; one whose tag fails is
            dropped like a failed exchange (``comm/unauthentic_messages``). ``None``: on for messages up to
            ``AUTO_MESSAGE_AUTH_ELEMENTS`` (64 MB of float32), where it costs little; off above, where hashing costs
            more than the transfer on a CPU-bound host (``docs/security.md``, ``benchmarks/message_auth.py``).
        **kwargs: the arguments of :class:`GASLoCStrategy` (``overlap``, bfloat16 messages, a network model and
            ``ranks_per_worker > 1`` are not supported in the elastic mode).
    """

    strategy_name = "gasloc_elastic"

    def __init__(
        self,
        *,
        lighthouse: str,
        worker_id: int,
        min_workers: int | None = None,
        max_workers: int = 8,
        allow_split_quorum: bool = False,
        connect_timeout: float = 10.0,
        quorum_timeout: float = 120.0,
        transfer_timeout: float = 60.0,
        heartbeat_interval: float = 0.1,
        first_quorum_delay: float = 0.0,
        gossip_timeout: float = 30.0,
        bind: str = "127.0.0.1",
        advertise: str | None = None,
        secret: str | None = None,
        leave_grace_s: float = 60.0,
        lighthouse_timeout: float = 30.0,
        lighthouse_wait: float = 60.0,
        member_auth: bool = True,
        message_auth: bool | None = None,
        **kwargs: Any,
    ) -> None:
        _check_int("max_workers", max_workers, 1)
        min_workers = quorum_floor(min_workers, max_workers, allow_split_quorum=allow_split_quorum)
        if is_split_quorum(min_workers, max_workers):
            warnings.warn(split_warning(min_workers, max_workers), SplitQuorumWarning, stacklevel=2)
        _check_int("worker_id", worker_id, 0)
        for name in ("overlap", "network", "error_feedback", "consensus_step", "fragment_sync_delay",
                     "fragment_update_alpha"):
            if kwargs.get(name):
                raise ValueError(f"{name} is not supported by {type(self).__name__}; leave it unset")
        check_codec(kwargs.get("message_codec") or "float32")  # a sparse (top-k) codec: say where it can be used
        for name in ("message_codec", "message_dtype"):
            if kwargs.get(name) not in (None, "float32"):
                raise ValueError(f"{type(self).__name__} sends float32 messages: {name} must be 'float32'")
        if kwargs.get("fragments", 1) != 1:
            raise ValueError(f"{type(self).__name__} exchanges whole models: fragments must be 1")
        if kwargs.get("intra_worker", "ddp") != "ddp":
            raise ValueError(f"{type(self).__name__} runs one process per worker: sharded workers "
                             f"(intra_worker={kwargs['intra_worker']!r}) are not supported in the elastic mode; "
                             "leave intra_worker='ddp' and ranks_per_worker=1")
        if kwargs.get("ranks_per_worker", 1) != 1:
            raise ValueError(f"{type(self).__name__} runs one process per worker: ranks_per_worker must be 1")
        if not isinstance(leave_grace_s, (int, float)) or isinstance(leave_grace_s, bool) or leave_grace_s < 0:
            raise ValueError(f"leave_grace_s must be a number of seconds >= 0, got {leave_grace_s!r}")
        if not isinstance(member_auth, bool):
            raise ValueError(f"member_auth must be true or false, got {member_auth!r}")
        if message_auth is not None and not isinstance(message_auth, bool):
            raise ValueError(f"message_auth must be true, false or None (on up to 64 MB messages), got {message_auth!r}")
        key = run_secret(secret)
        if key is None:
            raise ValueError("secret: the run's secret is missing: pass secret=... or set the environment variable "
                             "GASLOC_ELASTIC_SECRET on every worker (gasloc-elastic does it; see docs/security.md)")
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"secret: the run's secret (secret=... or GASLOC_ELASTIC_SECRET) has {len(key)} bytes, "
                             f"at least {MIN_SECRET_BYTES} are needed: anyone who reaches a quorum's store reads MACs "
                             "made with it and can test guesses offline. gasloc-elastic makes one (64 hex characters); "
                             "else use e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`")
        super().__init__(gossip_timeout=gossip_timeout, **kwargs)
        self._min_workers, self._max_workers = min_workers, max_workers
        self._leave_grace_s = float(leave_grace_s)
        self._member_auth, self._message_auth = member_auth, message_auth
        self._membership_args = dict(
            lighthouse=lighthouse, worker_id=worker_id, min_workers=min_workers, max_workers=max_workers,
            connect_timeout=connect_timeout, quorum_timeout=quorum_timeout, gossip_timeout=gossip_timeout,
            transfer_timeout=transfer_timeout, heartbeat_interval=heartbeat_interval,
            first_quorum_delay=first_quorum_delay, endpoint=Endpoint(bind=bind, advertise=advertise), secret=key,
            lighthouse_timeout=lighthouse_timeout, lighthouse_wait=lighthouse_wait,
        )
        ElasticMembership(**self._membership_args, state_dict=dict, load_state_dict=print)  # validates the args
        self._membership: ElasticMembership | None = None
        self._healed_rounds: list[int] = []
        self._lineage = LineageTracker()  # which model history this worker carries (comm/lineage.py)
        self._faults: FaultPoints | None = None
        self._own_replica: Tensor | None = None  # before the last end-of-fit all-reduce
        self._leave_requested_at: float | None = None  # when SIGTERM arrived
        self._taking_peer_state = False  # a peer's state is being checked and applied
        self._left = False  # this worker left the run (its replica is its own from then on)
        self._previous_sigterm: Any = None
        self._grace_timer: threading.Timer | None = None  # sends SIGTERM again when leave_grace_s is over
        self._reset_boundary_state()

    def _reset_boundary_state(self) -> None:
        """Per fit: where this worker stands between rounds (see the module docstring)."""
        self._quorum_due = False  # a round was committed: the next boundary starts the next quorum
        self._boundary = _START  # where this worker is while a quorum forms (told to the joiners it serves)
        self._source: dict[str, Any] = {}  # the boundary, step and ending of the peer that served the last heal
        self._skip_next_mean = False  # healed while validating, but the others are not: evaluate locally
        self._finished = False  # healed into the others' end-of-fit average: no step or collective follows

    # ------------------------------------------------------------------ properties
    @property
    def membership(self) -> ElasticMembership:
        if self._membership is None:
            raise RuntimeError(f"{type(self).__name__} has not joined yet (it does when fit starts)")
        return self._membership

    @property
    def quorum(self) -> Quorum:
        return self.membership.quorum

    @property
    def quorum_size(self) -> int:
        return self._membership.quorum.size if self._membership is not None else 0

    @property
    def membership_changes(self) -> int:
        return self._membership.membership_changes if self._membership is not None else 0

    @property
    def failed_exchanges(self) -> int:
        return self._transport.failed_exchanges if isinstance(self._transport, ElasticTransport) else 0

    @property
    def failed_collectives(self) -> int:
        """All-reduces over the quorum that failed (consensus evaluation, averages, DiLoCo rounds)."""
        return self._transport.failed_collectives if isinstance(self._transport, ElasticTransport) else 0

    @property
    def message_auth(self) -> bool:
        """Whether messages carry keyed tags (``None`` at construction: decided by the message's size)."""
        if self._message_auth is not None:
            return self._message_auth
        return self._layout is not None and self.layout.numel <= AUTO_MESSAGE_AUTH_ELEMENTS

    @property
    def refused_members(self) -> int:
        """Quorum members left out of the agreed admitted set (once per member and quorum): no secret, or too slow."""
        return self._transport.refused_members if isinstance(self._transport, ElasticTransport) else 0

    @property
    def tampered_agreements(self) -> int:
        """Quorums whose member-auth keys vanished or changed in the rendezvous store (reported; exchanges failed)."""
        return self._transport.tampered_agreements if isinstance(self._transport, ElasticTransport) else 0

    @property
    def unauthentic_messages(self) -> int:
        """Received messages or all-reduce chunks whose keyed tag failed (dropped, never used)."""
        return self._transport.unauthentic_messages if isinstance(self._transport, ElasticTransport) else 0

    @property
    def healed_rounds(self) -> list[int]:
        """Rounds at which this worker took a peer's state."""
        return list(self._healed_rounds)

    @property
    def lineage(self) -> Lineage:
        """This worker's model history: last committed round and the token of the quorum that committed it."""
        return self._lineage.lineage

    @property
    def lineage_merges(self) -> int:
        """Meetings of diverged lineages this worker took part in (each averaged the sides into one model)."""
        return self._lineage.merges

    @property
    def min_workers(self) -> int:
        return self._min_workers

    @property
    def left(self) -> bool:
        """Whether this worker left the run after SIGTERM (cleanly, at a round's end)."""
        return self._left

    @property
    def max_workers(self) -> int:
        return self._max_workers

    # ------------------------------------------------------------------ configuration
    @override
    def setup_distributed(self) -> None:
        """This worker's Lightning world is this process alone (its peers are reached through torchft), so no
        ``torch.distributed`` group is started: Lightning's would listen on every interface (its TCPStore) or on
        whatever the host name resolves to (gloo), and every collective of a world of one is a no-op."""
        reset_seed()
        self.set_world_ranks()

    @override
    def check_configuration(self, world_size: int) -> None:
        """Resolve gamma and check stability for every quorum size the run allows."""
        LocalStepsStrategy.check_configuration(self, world_size)
        if world_size != 1:
            raise ValueError(
                f"{type(self).__name__} runs one process per worker (Lightning's world is the worker): "
                f"set devices=1 and num_nodes=1, got a world of {world_size} processes"
            )
        if self._topology.name == "two_level":  # its round (algorithm/two_level.py) is another strategy's
            raise ValueError("topology two_level runs the two-level round: use ElasticTwoLevelStrategy "
                             "(strategies/elastic_two_level.py; gasloc-elastic picks it for topology=two_level or "
                             "hierarchical)")
        sizes = range(max(2, self._min_workers), self._max_workers + 1)
        for n in sizes:
            self._topology.check_world_size(n)
        if self._requested_momentum is None:
            defaults = [self._topology.default_outer_momentum(n, self._outer_form) for n in sizes]
            self._outer_momentum = min(defaults, default=0.0)
        else:
            self._outer_momentum = self._requested_momentum
        if self._topology.name != "local":
            for n in sizes:
                self._check_stability(n)

    @override
    def _init_outer_state(self) -> None:
        if self._outer_momentum is None:
            self.check_configuration(self.world_size)
        self._round = GossipRound(
            self.layout.read(), self.layout.num_parameter_elements, outer_lr=self._outer_lr,
            outer_momentum=self.outer_momentum, outer_form=self._outer_form,
            fused=False,  # the elastic round checks the point before its message, and a joiner must not compile late
        )
        self._pending = self._completed = None

    # ------------------------------------------------------------------ joining
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._check_trainer(self.lightning_module.trainer)
        self._reset_boundary_state()
        self._left, self._leave_requested_at, self._taking_peer_state = False, None, False
        self._membership = ElasticMembership(
            **self._membership_args, state_dict=self._peer_state, load_state_dict=self._take_peer_state,
            start_step=self.round_index,  # a resumed worker keeps its replica unless a peer is further
            max_state_bytes=_max_state_bytes(self.layout.numel),
        )
        key = self._membership_args["secret"]
        self._transport = ElasticTransport(
            self.layout.numel, self._membership, self.root_device,
            member_auth=MemberAuthenticator(key) if self._member_auth else None,
            message_auth=MessageAuthenticator(key) if self.message_auth else None)
        self._faults = FaultPoints.from_env(worker=self._membership.name, known=FAULT_POINTS)
        self._listen_for_sigterm()
        if self._leave_requested_at is not None:
            raise ElasticLeave("SIGTERM before joining")
        log.info("joining lighthouse=%s worker_id=%d round=%d bind=%s", self._membership.lighthouse,
                 self._membership.worker_id, self.round_index, self._membership.endpoint.bind)
        self._membership.connect()
        healed = self._membership.join().healed
        self._meet_lineages()
        if healed:
            self._follow_peer(_START)

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        """Members must validate at the same global steps (the consensus evaluation is a collective over the
        quorum), and a healed worker's step counters are moved to the quorum's, one batch per step."""
        name = type(self).__name__
        if any(isinstance(cb, Timer) for cb in trainer.callbacks):
            raise ValueError(f"{name} stops every member at the same global step: max_time (a Timer) would stop them "
                             "at different steps; give max_steps instead")
        if not trainer.max_steps or trainer.max_steps < 1:
            raise ValueError(f"{name} stops every member at the same global step: set max_steps (got "
                             f"{trainer.max_steps})")
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(f"{name} counts one batch per optimizer step: accumulate_grad_batches must be 1, "
                             f"got {trainer.accumulate_grad_batches}")
        if not trainer.enable_validation:
            return
        if getattr(trainer, "_val_check_time_interval", None) is not None:
            raise ValueError(f"{name} validates the consensus at steps every member shares: give "
                             "val_check_interval as a number of steps, not as a time")
        if trainer.check_val_every_n_epoch is not None:
            raise ValueError(
                f"{name} validates the consensus at global steps every member shares, but "
                f"check_val_every_n_epoch={trainer.check_val_every_n_epoch} schedules validation from each worker's "
                "own epoch (a restarted worker restarts its sampler): set check_val_every_n_epoch=None and "
                "val_check_interval=<steps>, or limit_val_batches=0"
            )

    def _signature(self) -> dict[str, Any]:
        """What every member of a run must share: the model's exchanged tensors, the hyperparameters, and
        everything that decides when a collective runs (so one worker's validation mean can never pair with
        another's round all-reduce of the same size)."""
        trainer = self.lightning_module.trainer
        optimizer = self.optimizers[0]
        callback = next((cb for cb in trainer.callbacks if isinstance(cb, GASLoCCallback)), None)
        return {
            "model": [self.layout.signature_digest(), self.layout.numel],
            "inner_steps": self.round_length, "outer_lr": self._outer_lr, "outer_momentum": self.outer_momentum,
            "outer_form": self._outer_form, "topology": self._topology.name, "seed": self._topology.seed,
            "optimizer": type(optimizer).__name__,
            # the constructor's, not the live group's: schedulers move lr, momentum and betas as they step
            "optimizer_hyperparameters": {k: _plain(v) for k, v in sorted(optimizer.defaults.items())
                                          if k != "lr" and not isinstance(v, Tensor)},
            # when collectives run: stop conditions, validation schedule, consensus measurements, quorum sizes
            "max_steps": trainer.max_steps, "max_epochs": trainer.max_epochs, "min_steps": trainer.min_steps,
            "limit_train_batches": _plain(trainer.limit_train_batches),
            "val_check_interval": _plain(trainer.val_check_interval),
            "limit_val_batches": _plain(trainer.limit_val_batches) if trainer.enable_validation else 0,
            "consensus_every": self._consensus_every, "min_workers": self._min_workers,
            "max_workers": self._max_workers,
            "evaluate": None if callback is None else [callback.evaluate, callback.average_at_end,
                                                       callback.local_loss_name],
        }

    @override
    def strategy_state_dict(self) -> dict[str, Any]:
        """The engine's state and this worker's lineage (a heal hands it over, a checkpoint resumes it)."""
        return {**super().strategy_state_dict(), "lineage": self._lineage.state_dict()}

    @override
    def load_strategy_state_dict(self, state: dict[str, Any]) -> None:
        super().load_strategy_state_dict(state)
        self._lineage.load_state_dict(state.get("lineage"))

    def _peer_state(self) -> dict[str, Any]:
        """This worker's state for a joiner. Called from torchft's quorum thread while this worker's main thread
        waits in ``start_quorum`` (so nothing moves); copies, since the transport serves them later."""
        strategy = self.strategy_state_dict()
        strategy.pop("counters", None)  # traffic counters stay each worker's own
        return _cloned({
            "signature": self._signature(),
            "live": self.layout.read(),
            "strategy": strategy,
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            "schedulers": [config.scheduler.state_dict() for config in self.lr_scheduler_configs],
            "boundary": {"at": self._boundary, "step": self.lightning_module.trainer.global_step,
                         "ending": self._ending()},
        })

    def _ending(self) -> bool:
        """Whether this worker's fit ends at this boundary (its end-of-fit average is the next collective)."""
        trainer = self.lightning_module.trainer
        return self._boundary == _AVERAGE or 0 < trainer.max_steps <= trainer.global_step

    def _take_peer_state(self, state: dict[str, Any]) -> None:
        # True until it is all applied: a leave must not checkpoint half of it. Not reset in a ``finally``: a leave
        # that interrupts the application must still see it (a refused state fails the fit anyway).
        self._taking_peer_state = True
        self._take_checked_peer_state(state)
        self._taking_peer_state = False

    def _take_checked_peer_state(self, state: dict[str, Any]) -> None:
        self._check_peer_state(state)
        before = self._lineage.lineage
        try:  # a load that raises anyway (after every check passed) restores every piece: nothing is half applied
            apply_all_or_nothing(self._healed_parts(state))
        except StateApplyError as error:
            raise ElasticJoinError(f"{self.membership.name} refused a peer's state: {error}") from error
        self._lineage.healed(before, self.membership.name)
        self._source = dict(state["boundary"])
        self._healed_rounds.append(self.round_index)
        log.info("took a peer's state worker=%s round=%d", self.membership.name, self.round_index)

    def _healed_parts(self, state: dict[str, Any]) -> list[tuple[StatePart, Any]]:
        """What a heal replaces, in order, each with the peer's state for it."""
        parts = [(StatePart("live", self.layout.read, lambda flat: self.layout.scatter(flat.to(self.layout.device))),
                  state["live"]),
                 (StatePart("strategy", self.strategy_state_dict, self.load_strategy_state_dict), state["strategy"])]
        parts += [(StatePart(f"optimizers.{index}", optimizer.state_dict, optimizer.load_state_dict), received)
                  for index, (optimizer, received) in enumerate(zip(self.optimizers, state["optimizers"]))]
        parts += [(StatePart(f"schedulers.{index}", config.scheduler.state_dict, config.scheduler.load_state_dict),
                   received) for index, (config, received) in enumerate(zip(self.lr_scheduler_configs,
                                                                            state["schedulers"]))]
        return parts

    def _check_peer_state(self, state: Any) -> None:
        """Nothing of a peer's state replaces this worker's until it is shown to be this run's: only tensors and
        plain data (already loaded without unpickling), finite, the same signature, this model's exchanged tensors,
        the outer state's tensors, and optimizer state shaped like this worker's parameters."""
        try:
            check_plain(state, path="peer")
            if not isinstance(state, dict) or set(state) != _PEER_STATE_KEYS:
                raise UnsafePayloadError(f"peer: keys {sorted(state) if isinstance(state, dict) else type(state)} "
                                         f"expected {sorted(_PEER_STATE_KEYS)}")
            self._refuse_if_different(state["signature"])
            check_like(state["live"], self.layout.read(), path="peer.live")
            self._check_like_own_strategy(state["strategy"])
            for index, (optimizer, received) in enumerate(zip(self.optimizers, state["optimizers"], strict=True)):
                _check_optimizer_state(received, optimizer, f"peer.optimizers.{index}")
            check_like(state["schedulers"], [config.scheduler.state_dict() for config in self.lr_scheduler_configs],
                       path="peer.schedulers")
            _check_boundary(state["boundary"])
        except (UnsafePayloadError, ValueError, KeyError, TypeError) as error:
            raise ElasticJoinError(f"{self.membership.name} refused a peer's state (nothing was applied): "
                                   f"{error}") from error

    def _check_like_own_strategy(self, received: Any) -> None:
        mine = self.strategy_state_dict()
        mine.pop("counters", None)
        if not isinstance(received, dict) or set(received) != set(mine):
            raise UnsafePayloadError(f"peer.strategy: keys {sorted(received) if isinstance(received, dict) else '?'} "
                                     f"expected {sorted(mine)}")
        for key, value in mine.items():  # None here (not measured or kept yet on this worker): any plain value
            if value is not None:
                check_like(received[key], value, path=f"peer.strategy.{key}")

    def _refuse_if_different(self, theirs: dict[str, Any]) -> None:
        mine = self._signature()
        differ = {key: (theirs.get(key), value) for key, value in mine.items() if _plain(theirs.get(key)) != _plain(value)}
        if differ:
            details = "; ".join(f"{key}: running={a!r} this worker={b!r}" for key, (a, b) in differ.items())
            raise ElasticJoinError(
                f"{self.membership.name} refused to join: its model or hyperparameters differ from the running "
                f"workers' ({details}). Start it with the same configuration."
            )

    def _align_trainer(self, step: int, mine: str) -> None:
        """Move Lightning's step and batch counters to ``step`` (the serving peer's): a healed worker continues
        where the others are. ``mine`` is where this worker is, since Lightning counts differently there:

        - ``train`` (the strategy's ``on_train_batch_start``): this batch is counted as ready, not yet started;
        - ``validate`` (after a batch): the batch is counted, but ``_batches_that_stepped`` only after validation;
        - ``start`` (fit start): nothing of the first batch is counted.
        """
        loop = self.lightning_module.trainer.fit_loop.epoch_loop
        for progress in (loop.automatic_optimization.optim_progress.optimizer.step.total,
                         loop.manual_optimization.optim_step_progress.total):
            progress.ready = progress.completed = step
        batches = loop.batch_progress.total
        batches.ready = step + (1 if mine == _TRAIN else 0)
        batches.started = batches.processed = batches.completed = step
        loop._batches_that_stepped = step - (1 if mine == _VALIDATE else 0)

    # ------------------------------------------------------------------ round boundaries
    def _start_due_quorum(self, boundary: str) -> None:
        """At a boundary after a committed round: form the next quorum (healing this worker if it is behind)."""
        # (a finished worker never has one due: its steps are not counted, so no round ends)
        if not self._quorum_due or self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            return
        if self._leave_requested_at is not None:  # SIGTERM after the round's commit: nothing left to finish
            self._leave_at(boundary)
            return
        self._quorum_due = False
        self._boundary = boundary
        heals = len(self._healed_rounds)
        try:
            quorum = self.membership.start_quorum()
        except SurplusWorkerError:
            raise  # refused (past max_workers), not a leave
        except (MembershipError, ElasticLeave) as error:
            if self._leave_requested_at is None or len(self._healed_rounds) != heals or self._taking_peer_state:
                raise  # not leaving, or a peer's state was (being) applied: this state is no round's end
            # SIGTERM came while this worker waited, and no quorum formed (the others left too, as when a whole run
            # is stopped at once): its last round is committed, so it leaves as if the signal had come before it
            # asked, with its checkpoint.
            log.warning("no quorum after SIGTERM worker=%s: leaving after round %d (%s)", self.membership.name,
                        self.round_index, error)
            self._leave_at(boundary)
            return
        self._meet_lineages()
        if quorum.healed:  # a worker that stalled and came back
            self._follow_peer(boundary)

    def _meet_lineages(self) -> None:
        """Right after every quorum this worker trains or averages in, on every member alike: if members of several
        lineages meet in it, they end on one model (comm/lineage.py). Not in a quorum at the final step: the
        end-of-fit average is committed there, and its heal gives every member that model."""
        if is_final(self.quorum.max_step):
            return
        try:
            meeting = self._lineage.reconcile(self.quorum, self._transport, self.layout.read())
        except LineageExchangeError as error:  # reported with the round's commit: the next quorum meets again
            log.warning("lineage exchange failed worker=%s: %s", self.membership.name, error)
            self._transport.failed_collectives += 1
            self._transport.error = self._transport.error or error
            return
        if meeting is not None and meeting.merged:
            self.layout.scatter(self.layout.read())
            self._on_replicas_averaged()

    def _follow_peer(self, mine: str) -> None:
        """After taking a peer's state at boundary ``mine``: align the trainer and do what the peer does next.

        The peer may be at another boundary (a worker that was behind validates at steps the others passed):
        the collectives of the two must still pair up one to one. What the peer does next: the replica mean of
        a validation (``validate``), then the round's exchange (``train``) or, if its fit ends here, the
        end-of-fit average."""
        theirs, step, ending = self._source["at"], self._source["step"], self._source["ending"]
        finishing = ending and mine == _TRAIN  # this worker's batch would train: it must end with the others
        self._align_trainer(step - 1 if finishing else step, mine)  # the untrained batch then lands on step
        if theirs == _VALIDATE and mine != _VALIDATE:
            self._replica_mean(self.layout.read())  # the others' consensus evaluation: take part, discard
        if mine == _VALIDATE and theirs != _VALIDATE:
            self._skip_next_mean = True  # the others are not evaluating: this validation uses the local replica
        # ``start`` and ``validate`` reach the end-of-fit average on their own: the fit loop sees the aligned step
        if finishing:
            self.average_replicas()  # returns at once if the peer's average is committed (its heal gave it)
            self._finished = True
            self.lightning_module.trainer.should_stop = True
            log.info("healed into the end-of-fit average worker=%s: no further step", self.membership.name)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._abandon_if_grace_is_over()
        self._start_due_quorum(_TRAIN)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._finished:  # Lightning needs the closure run; the averaged model stays as it is
            return closure()
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def swap_in_consensus(self) -> None:
        self._start_due_quorum(_VALIDATE)
        super().swap_in_consensus()

    @override
    def average_replicas(self) -> None:
        """The end-of-fit average over the live quorum, retried over the survivors (a new quorum each time) until
        it succeeds or no quorum forms within ``quorum_timeout``; a worker that left keeps its own replica."""
        if self._finished or self._left:
            return
        self._start_due_quorum(_AVERAGE)
        if self._left:  # SIGTERM came after the last round: it keeps its own replica
            return
        if is_final(self.quorum.max_step):  # healed from a peer that holds the committed average
            return
        FinalAverage(self.membership, average_once=self._average_once, restore_own=self._restore_own_replica,
                     take_error=self._transport.take_error, leaving=lambda: self._leave_requested_at is not None,
                     faults=self._faults, quorum_formed=self._meet_lineages).run(self.round_index)

    def _average_once(self) -> bool:
        """One all-reduce of the replicas over the quorum, applied on success (the own replica is kept otherwise)."""
        self._own_replica = self.layout.read().clone()
        failures = self.failed_collectives
        super().average_replicas()
        return self.failed_collectives == failures and self._membership_connected()

    def _restore_own_replica(self) -> None:
        self.layout.scatter(self._own_replica)
        self._on_replicas_averaged()

    # ------------------------------------------------------------------ the round
    @override
    def peers(self, round_index: int | None = None) -> dict[int, float]:
        """This worker's peers in the current quorum (indices in its sorted member list) and weights w_ij: the
        topology's graph over the admitted members (all, or those that passed member authentication)."""
        quorum = self.quorum
        if quorum.size <= 1 or not quorum.usable:  # e.g. larger than max_workers: no graph of that size
            return {}
        admitted = self._transport.admitted()  # the same list on every honest member
        if len(admitted) < max(2, self._min_workers):
            return {}
        t = quorum.max_step if round_index is None else round_index  # identical on every member
        weights = self._topology.mixing_weights(admitted.index(quorum.index), len(admitted), t)
        return {admitted[node]: weight for node, weight in weights.items()}

    @override
    @torch.no_grad()
    def _communicate(self) -> None:
        layout, round_ = self.layout, self._round
        point = layout.read()
        self._guard_local_point(point, round_.outer.round_start)
        all_reduce = self._topology.uses_all_reduce
        wire = round_.begin(point, send=not all_reduce)  # point: u_i
        if all_reduce:
            self._all_reduce_round(point)
            round_.mixed.copy_(layout.split(point)[0])
        else:
            pending = self._transport.post(wire, self.peers(), self.round_index)
            received, completed = self._transport.complete(pending)
            for index in round_.mix(point, received):
                self._guard.reject(completed[index], self._where())
        round_.finish(point)
        layout.scatter(point)

    def _all_reduce_round(self, message: Tensor) -> None:
        """The complete graph over the quorum; if a member fails, this worker keeps its own point."""
        backup = self._transport.receive_buffer(0)
        backup.copy_(message)
        try:
            self._round_mean_of(message)
        except ElasticCollectiveError as error:
            log.warning("all-reduce round failed round=%d: %s (own point kept)", self.round_index, error)
            message.copy_(backup)
            return
        if not all_finite(message):  # a member sent non-finite values: nobody takes the poisoned mean
            self._guard.rejected_exchanges += 1
            log.warning("all-reduce round gave non-finite values round=%d (own point kept)", self.round_index)
            message.copy_(backup)

    def _round_mean_of(self, message: Tensor) -> None:
        """The round's mean of the messages over the quorum, in place (the elastic DiLoCo's codec overrides it)."""
        self._transport.all_reduce_mean(message, round_exchange=True)

    @override
    def end_round(self) -> None:
        super().end_round()
        self.membership.commit(self.round_index, self._transport.take_error())
        self._lineage.committed(self.round_index, self.quorum)
        self._quorum_due = True  # formed at the next boundary (see the module docstring)
        if self._leave_requested_at is not None:
            self._leave()

    # ------------------------------------------------------------------ leaving (SIGTERM)
    def _listen_for_sigterm(self) -> None:
        """For this fit, SIGTERM means "leave after this round" (Lightning's own handler would stop mid-round and
        fail the peers' exchange). The handler found here is put back at teardown."""
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._leave_requested_at is None:
            self._leave_requested_at = time.monotonic()
            log.warning("SIGTERM worker=%s: leaving after this round (leave_grace_s=%g)",
                        self._membership.name if self._membership else "?", self._leave_grace_s)
            # A quorum being formed may already count this worker: it then trains that round and leaves at its end.
            # If the wait outlasts the grace, this signal comes again and abandons it.
            self._grace_timer = threading.Timer(self._leave_grace_s, os.kill, (os.getpid(), signal.SIGTERM))
            self._grace_timer.daemon = True
            self._grace_timer.start()
            return
        over = time.monotonic() - self._leave_requested_at >= self._leave_grace_s - 0.01
        if over and self._membership is not None and self._membership.waiting:
            # No round of its own in progress; if its request made a quorum, that round's peers count one failed
            # exchange with it.
            raise ElasticLeave(f"SIGTERM {self._leave_grace_s:g}s ago (leave_grace_s) and still waiting for a "
                               "quorum: left without a round to finish")

    def _abandon_if_grace_is_over(self) -> None:
        if self._leave_requested_at is None or time.monotonic() - self._leave_requested_at <= self._leave_grace_s:
            return
        raise ElasticLeave(f"SIGTERM {self._leave_grace_s:g}s ago (leave_grace_s) and round {self.round_index} has "
                           "not ended: this worker abandons it (its peers count a failed exchange)")

    def _leave_at(self, boundary: str) -> None:
        """Leave at ``boundary``, after a committed round; at a training step, before that step's batch trains."""
        self._leave()
        if boundary == _TRAIN:
            raise StopIteration  # ends Lightning's epoch before this batch trains (the fit then stops)

    def _leave(self) -> None:
        """Right after a committed round: stop heartbeating and stop the fit; this worker keeps its own replica."""
        self._left, self._quorum_due = True, False
        self.membership.leave()
        self.lightning_module.trainer.should_stop = True
        log.info("left worker=%s round=%d step=%d", self.membership.name, self.round_index,
                 self.lightning_module.trainer.global_step)

    def _restore_sigterm_handler(self) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        self._previous_sigterm = None

    # ------------------------------------------------------------------ consensus over the quorum
    @override
    @torch.no_grad()
    def measure_consensus_distance(self) -> float | None:
        """Mean over the quorum of ||theta_i - mean(theta)||^2 (None if a member failed meanwhile)."""
        if self.quorum_size <= 1:
            return 0.0
        params, _ = self.layout.split(self.layout.read())
        mean = self._replica_mean(params)
        distance = torch.sub(params, mean, out=mean).pow_(2).sum().reshape(1)
        try:
            return float(self._transport.all_reduce_mean(distance).item())
        except ElasticCollectiveError:
            return None

    @override
    def _replica_mean(self, flat: Tensor) -> Tensor:
        mean = self._mean_buffer()[: flat.numel()]
        mean.copy_(flat)
        local_only = self._finished or self._skip_next_mean or not self._membership_connected()
        self._skip_next_mean = False
        if self.quorum_size > 1 and not local_only:
            try:
                self._transport.all_reduce_mean(mean)
            except ElasticCollectiveError as error:
                log.warning("average over the quorum failed: %s (this worker's replica used instead)", error)
                mean.copy_(flat)
        return mean

    # ------------------------------------------------------------------ wiring
    @override
    def _attach_callback(self, trainer: pl.Trainer) -> None:
        super()._attach_callback(trainer)
        if not any(isinstance(cb, ElasticMetricsCallback) for cb in trainer.callbacks):
            trainer.callbacks.append(ElasticMetricsCallback())

    def _membership_connected(self) -> bool:
        return self._membership is not None and self._membership.connected

    @override
    def teardown(self) -> None:
        self._restore_sigterm_handler()
        if self._membership is not None:
            self._membership.shutdown()
        if isinstance(self._transport, ElasticTransport) and self._transport.message_auth is not None:
            self._transport.message_auth.close()  # its hashing threads (a later tag starts them again)
        self._reset_boundary_state()  # a later validate/test evaluates locally and forms no quorum
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Not registered by name: the elastic arguments (lighthouse, worker_id) have no defaults."""


class ElasticDiLoCoStrategy(ElasticGASLoCStrategy):
    """DiLoCo on the same elastic engine: the complete graph over the live quorum (an all-reduce).

    Douillard et al., arXiv 2311.08105. Identical to :class:`ElasticGASLoCStrategy` with ``topology="complete"``
    (docs/algorithm.md section 2); a failed all-reduce keeps each worker's own point for that round.
    Takes the same arguments, without ``topology``; ``outer_momentum`` defaults to DiLoCo's 0.9.

    Args:
        message_codec: ``"float32"`` (an exact all-reduce) or a lossy codec (``int8``, ``int4``, ``fp8``,
            ``bfloat16``): the round's mean is then a quantized mean of ``u_i - round_start`` over the quorum's
            admitted members, the same bits as the static DiLoCo's
            (:class:`~gasloc_lightning.comm.elastic_encoded_mean.QuantizedRoundMean`: the first round of every
            quorum stays exact, which brings its members to one round start).
        overlap: with a lossy codec, the mean is posted after the round's last step but one (the prepare point)
            and waited on after its last step (where it is applied), that step computing meanwhile: Streaming
            DiLoCo with one fragment and ``fragment_sync_delay=1`` (the last step's own progress is replaced by the
            mean, ``fragment_update_alpha=0``). Whole models only: ``fragments`` stays 1.
    """

    strategy_name = "diloco_elastic"

    def __init__(self, *, outer_momentum: float | None = 0.9, message_codec: str = "float32", overlap: bool = False,
                 **kwargs: Any) -> None:
        if "topology" in kwargs:
            raise ValueError("ElasticDiLoCoStrategy always uses topology='complete'; do not pass topology")
        check_codec(message_codec)  # a sparse (top-k) codec: the elastic mode's own refusal, which says where to go
        if message_codec != "float32":
            QuantizedRoundMean.check_codec(message_codec)
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be true or false, got {overlap!r}")
        if overlap and message_codec == "float32":
            raise ValueError("ElasticDiLoCoStrategy overlaps only a quantized mean: with overlap=True set "
                             "message_codec to int8 or int4 (the float32 all-reduce runs where it is applied)")
        super().__init__(topology="complete", outer_momentum=outer_momentum, **kwargs)
        # not GASLoCStrategy's _message_codec and _overlap: the gossip round stays float32 and in step
        self._round_codec, self._round_overlap = message_codec, overlap
        self._quantized_mean: QuantizedRoundMean | None = None
        self._prepared: Tensor | None = None

    @property
    def message_codec(self) -> str:
        return self._round_codec

    @property
    def overlap(self) -> bool:
        """Whether the round's quantized mean runs under its last step (not GASLoC's one-round-late overlap)."""
        return self._round_overlap

    @property
    def quantized_mean(self) -> QuantizedRoundMean | None:
        """This fit's quantized round mean (None with float32 messages, or before the fit starts)."""
        return self._quantized_mean

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._round_codec != "float32":
            self._quantized_mean = QuantizedRoundMean(self._transport, self._round_codec,
                                                      self.layout.num_parameter_elements)

    @override
    def _signature(self) -> dict[str, Any]:
        return {**super()._signature(), "message_codec": self._round_codec, "overlap": self._round_overlap}

    @override
    def _round_mean_of(self, message: Tensor) -> None:
        if self._quantized_mean is None:
            return super()._round_mean_of(message)
        self._quantized_mean.apply(message, self._round.outer.round_start, self.round_index)

    @override
    @torch.no_grad()
    def _after_inner_step(self, step_in_round: int) -> None:
        super()._after_inner_step(step_in_round)
        if self._round_overlap and self._quantized_mean is not None and step_in_round == self.round_length - 1:
            params, _ = self.layout.split(self.layout.read())  # the prepare point: u_i of this step's point
            self._prepared = params.clone() if self._prepared is None else self._prepared.copy_(params)
            self._quantized_mean.post(self._round.outer.message(self._prepared), self._round.outer.round_start,
                                      self.round_index)

    @override
    def _replica_mean(self, flat: Tensor) -> Tensor:
        if self._quantized_mean is not None:
            self._quantized_mean.drain()  # a consensus evaluation inside the round: the group is its alone
        return super()._replica_mean(flat)


# The heal server's counters (comm/state_transfer.py): peer-triggered events are counted here, not logged line by line.
_HEAL_METRICS = {"served": "heal/served_requests", "refused": "heal/refused_requests", "aborted": "heal/aborted_requests",
                 "not_staged": "heal/not_staged_requests", "log_lines_suppressed": "heal/log_lines_suppressed"}


class ElasticMetricsCallback(Callback):
    """Logs ``elastic/quorum_size``, ``elastic/membership_changes``, ``elastic/lineage_merges``,
    ``comm/failed_exchanges``, ``comm/failed_collectives``, ``comm/refused_members``,
    ``comm/unauthentic_messages``, ``comm/tampered_agreements`` and the heal server's counters (``heal/served_requests``,
    ``heal/refused_requests``, ``heal/aborted_requests``, ``heal/not_staged_requests``,
    ``heal/log_lines_suppressed``) at the steps Lightning writes its own rows (``log_every_n_steps``).

    They go straight to the loggers, as ``LearningRateMonitor`` writes its rates: they are counters of the
    strategy, not of the module, and ``LightningModule.log`` costs a metric-state move per key and step (with
    13 keys, a quarter of a tiny model's worker CPU). So they are not in ``trainer.callback_metrics``."""

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, ElasticGASLoCStrategy) or not trainer.is_global_zero or not trainer.loggers:
            return
        # Checked here as Lightning checks it for its own row, right after this hook (same step, same answer).
        if not trainer._logger_connector.should_update_logs:
            return
        metrics = {
            "elastic/quorum_size": float(strategy.quorum_size),
            "elastic/membership_changes": float(strategy.membership_changes),
            "elastic/lineage_merges": float(strategy.lineage_merges),
            "comm/failed_exchanges": float(strategy.failed_exchanges),
            "comm/failed_collectives": float(strategy.failed_collectives),
            "comm/refused_members": float(strategy.refused_members),
            "comm/unauthentic_messages": float(strategy.unauthentic_messages),
            "comm/tampered_agreements": float(strategy.tampered_agreements),
            **{_HEAL_METRICS[name]: float(count) for name, count in strategy.membership.heal_server_counters.items()},
        }
        for logger in trainer.loggers:  # at the step number Lightning gives this step's row
            logger.log_metrics(metrics, step=trainer.fit_loop.epoch_loop._batches_that_stepped)


def _max_state_bytes(numel: int) -> int:
    """A bound on a peer's serialized state: float32 live point, outer state (round start, anchor or momentum) and
    inner optimizer state (AdamW's two moments) are about 6 model copies; 16 leave room for other optimizers."""
    return 16 * 4 * numel + (64 << 20)


_PEER_STATE_KEYS = frozenset({"signature", "live", "strategy", "optimizers", "schedulers", "boundary"})


def _check_optimizer_state(received: Any, optimizer: torch.optim.Optimizer, path: str) -> None:
    """A peer's ``optimizer.state_dict()``: this optimizer's groups and parameters, and per-parameter tensors that
    are scalars (a step count) or shaped like the parameter."""
    mine = optimizer.state_dict()
    if not isinstance(received, dict) or set(received) != set(mine):
        raise UnsafePayloadError(f"{path}: keys expected {sorted(mine)}")
    check_like(received["param_groups"], mine["param_groups"], path=f"{path}.param_groups")
    groups = received["param_groups"]
    if len(groups) != len(mine["param_groups"]) or any(
            list(theirs.get("params", ())) != list(own["params"]) for theirs, own in zip(groups, mine["param_groups"])):
        raise UnsafePayloadError(f"{path}.param_groups: parameter indices differ from this worker's")
    shapes = {index: param.shape for group, own in zip(optimizer.param_groups, mine["param_groups"])
              for index, param in zip(own["params"], group["params"])}
    for index, entry in received["state"].items():
        if index not in shapes or not isinstance(entry, dict):
            raise UnsafePayloadError(f"{path}.state.{index}: no such parameter")
        for name, value in entry.items():  # per-parameter statistics: at most the parameter's size (Adafactor
            # keeps a row and a column vector, Adam a full copy, step counts are scalars)
            if isinstance(value, Tensor) and value.numel() > max(1, math.prod(shapes[index])):
                raise UnsafePayloadError(f"{path}.state.{index}.{name}: shape {tuple(value.shape)} is larger than "
                                         f"its parameter's {tuple(shapes[index])}")


def _check_boundary(boundary: Any) -> None:
    """Where the serving peer is: one of the four boundaries, a step and whether its fit ends there."""
    if (not isinstance(boundary, dict) or set(boundary) != {"at", "step", "ending"}
            or boundary["at"] not in (_START, _TRAIN, _VALIDATE, _AVERAGE) or type(boundary["step"]) is not int
            or boundary["step"] < 0 or type(boundary["ending"]) is not bool):
        raise UnsafePayloadError(f"peer.boundary: {boundary!r} is not a boundary")


def _cloned(value: Any) -> Any:
    if isinstance(value, Tensor):  # contiguous: a receiver accepts only tensors that own a dense storage
        return value.detach().clone(memory_format=torch.contiguous_format)
    if isinstance(value, dict):
        return {key: _cloned(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(item) for item in value)
    return value


def _plain(value: Any) -> Any:
    """Comparable form of a hyperparameter (tuples and lists alike)."""
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
