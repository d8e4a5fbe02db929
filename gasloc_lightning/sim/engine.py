"""The simulated run: n workers' local steps, rounds, churn, validation and metrics in one process.

The loop is the multi-process strategy's, counted the same way: every optimizer step is one step of
every worker; after H steps the round runs (``GossipRounds`` or ``DiLoCoRounds``); a final shorter
round runs if steps remain at the end, then any exchange still in flight is folded in. Validation
evaluates the average of the live replicas on every worker's validation windows (what the
strategy's consensus evaluation computes, gathered in one place). Under churn only the live workers
draw a batch and compute; joins follow the elastic mode (see :mod:`gasloc_lightning.sim.churn`).

Clock rules of a validation (what a real run could measure):

* it runs at the round boundary *before* that boundary's churn: its consensus and its time stamp are over
  the workers that trained the round, not the ones that join for the next round (a joiner's clock, its
  source's plus the state transfer, is not the time the round's consensus existed);
* the consensus is a collective: a full-model float32 all-reduce over those workers, posted when each reaches
  the validation and not waited on by training (an asynchronous all-reduce, as torch's ``async_op``); the
  validation is stamped when it ends, the latest of their clocks plus the all-reduce's time. So no barrier
  brings the clocks together, and the stamp is still a time a run could read off: the moment the consensus
  model exists.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from gasloc_lightning.sim.churn import ChurnSchedule
from gasloc_lightning.sim.cohorts import CohortReplicas
from gasloc_lightning.sim.data import ShardedBatches
from gasloc_lightning.sim.replicas import StackedReplicas
from gasloc_lightning.strategies.guards import NonFiniteGuard
from gasloc_lightning.sim.rounds import DiLoCoRounds, GossipRounds, WorkerClocks

log = logging.getLogger(__name__)

MetricsSink = Callable[[int, dict[str, float]], None]


class Simulator:
    """Trains ``replicas`` for ``max_steps`` steps with a round every ``inner_steps`` steps.

    Args:
        replicas: the stacked replicas and their inner optimizer (cohorts of equal H_i when they differ).
        rounds: the communication round (GASLoC, local, DiLoCo, or two-level).
        clocks: the workers' simulated clocks (shared with ``rounds``).
        batches: each worker's training batches and the validation windows.
        inner_steps: steps per round: H, or max_i H_i with cohorts.
        max_steps: optimizer steps per worker.
        val_check_interval: validate every this many steps (None: only at the end).
        consensus_every: measure the consensus distance every this many rounds (0: not between validations;
            every validation measures it anyway, with the replicas' spread).
        churn: the leave/join schedule (None: every worker stays).
        progress_every: print progress every this many rounds (0: never).
        metrics: receives ``(step, {name: value})`` rows, as a Lightning logger would.
        attention_math: compute attention with the math kernel, which has a batching rule
            (the fused CPU kernel falls back to a loop over replicas under vmap).
        on_nonfinite, max_skipped_rounds: what a worker whose point is not finite at a round's end does, as the
            strategy (:class:`~gasloc_lightning.strategies.guards.NonFiniteGuard`, one per worker): discard that
            round's local steps (its point back to the round start, non-finite optimizer state zeroed) and still
            take part, or raise.
    """

    def __init__(
        self,
        *,
        replicas: StackedReplicas | CohortReplicas,
        rounds: GossipRounds | DiLoCoRounds,
        clocks: WorkerClocks,
        batches: ShardedBatches,
        inner_steps: int,
        max_steps: int,
        val_check_interval: int | None = None,
        consensus_every: int = 10,
        churn: ChurnSchedule | None = None,
        progress_every: int = 10,
        metrics: MetricsSink | None = None,
        attention_math: bool = True,
        on_nonfinite: str = "skip_round",
        max_skipped_rounds: int = 3,
    ) -> None:
        for name, value in (("inner_steps (H)", inner_steps), ("max_steps", max_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if churn is not None and getattr(rounds, "overlap", False):
            raise ValueError("churn with overlap=True is not simulated: a leaving worker's correction in flight "
                             "would have no defined owner; turn one of them off")
        self.replicas, self.rounds, self.clocks, self.batches = replicas, rounds, clocks, batches
        self.inner_steps, self.max_steps = inner_steps, max_steps
        self.val_check_interval, self.consensus_every = val_check_interval, consensus_every
        self.churn, self.progress_every = churn, progress_every
        self._metrics = metrics or (lambda step, row: None)
        self._attention = (lambda: sdpa_kernel(SDPBackend.MATH)) if attention_math else nullcontext
        self.workers = replicas.workers
        self.guards = [NonFiniteGuard(on_nonfinite, max_skipped_rounds) for _ in range(self.workers)]
        self.round_index = 0
        self.step = 0
        self.consensus_distance: float | None = None
        self._last_train_loss = float("nan")
        self._live = list(range(self.workers)) if churn is None else list(churn.live(0))
        self.joins = 0  # workers that joined (each pulled join_state_bytes from a live peer)
        self.tokens_seen = 0  # training tokens of the live workers' batches, summed over workers
        self._start = time.perf_counter()

    @property
    def live(self) -> list[int]:
        return list(self._live)

    @property
    def skipped_rounds(self) -> list[int]:
        """Rounds each worker discarded for a non-finite point."""
        return [guard.skipped_rounds for guard in self.guards]

    @property
    def bytes_sent_mean(self) -> float:
        return float(self.rounds.bytes_sent.mean())

    def run(self) -> dict[str, Any]:
        """Train to ``max_steps``, then :meth:`finish`; returns the final validation metrics and counters."""
        final = self.train()
        self.finish()
        return {"final": final, "rounds": self.round_index, "steps": self.step,
                "wall_time_s": time.perf_counter() - self._start, "bytes_sent": self.bytes_sent_mean,
                "goodput": 1.0 if self.churn is None else self.churn.goodput(), "joins": self.joins,
                "tokens": self.tokens_seen}

    def train(self) -> dict[str, float]:
        """The training loop (steps, rounds, validations); returns the last validation's metrics."""
        self._start = time.perf_counter()
        steps_in_round, final = 0, {}
        with self._attention():
            for step in range(1, self.max_steps + 1):
                self.step = step
                self._inner_step(step, steps_in_round)
                steps_in_round += 1
                self._after_inner_step(steps_in_round)
                boundary = steps_in_round == self.inner_steps
                if boundary:
                    self._end_round()
                    steps_in_round = 0
                if self._validates(step):
                    final = self.validate()  # over the workers that trained the round: before its churn
                if boundary:
                    self._apply_churn()
            if steps_in_round:  # a final, shorter round, as the strategy runs at the end of training
                self._end_round()
        return final

    def finish(self) -> None:
        """End of training: fold in any exchange still in flight (overlap)."""
        self.rounds.flush(self.replicas.gather())
        self.replicas.scatter()

    def _validates(self, step: int) -> bool:
        interval = self.val_check_interval
        return step == self.max_steps or (interval is not None and step % interval == 0)

    def _inner_step(self, step: int, step_in_round: int) -> None:
        # Down workers compute nothing: no batch drawn (their samplers stand still), no pass, no time.
        rows = None if len(self._live) == self.workers else self._live
        x, y = self.batches.next_batch(rows)  # (m, B, T), the live workers' batches
        self.tokens_seen += x.numel()
        losses = self.replicas.train_step(x, y, step_in_round, rows=rows)  # (m,)
        applied = set(self.replicas.applies(step_in_round))
        self.clocks.advance_compute([i for i in self._live if i in applied])  # a step not applied takes no time
        self._last_train_loss = float(losses.mean())
        row = {"train/loss": self._last_train_loss, "lr": self.replicas.lr}
        if self.clocks.enabled:
            row["sim_time"] = self.clocks.times()[0]
        self._metrics(step - 1, row)

    def _after_inner_step(self, step_in_round: int) -> None:
        """Streamed rounds: fragments that leave or land after this step (as the strategy's hook)."""
        after_step = getattr(self.rounds, "after_step", None)
        if after_step is not None and after_step(self.replicas.gather(), step_in_round, self._live):
            self.replicas.scatter()

    def _end_round(self) -> None:
        flat = self.replicas.gather()
        live = self._live
        if getattr(self.rounds, "points", None) is None:  # streamed rounds check each fragment instead
            for i in live:
                if not self.guards[i].local_point_is_usable(flat[i], f"worker {i}, round {self.round_index}"):
                    self.rounds.restore_round_start(flat, i)
                    self.replicas.zero_nonfinite_state(i)
        self.rounds.communicate(flat, self.round_index, live)
        self.replicas.scatter()
        self.round_index += 1
        row = {"comm/round": float(self.round_index), "comm/bytes_sent": self.bytes_sent_mean,
               "comm/workers_alive": float(len(live))}
        row.update(getattr(self.rounds, "level_bytes", dict)())  # two-level rounds: each level's bytes
        if self.consensus_every and self.round_index % self.consensus_every == 0:
            self.consensus_distance = self.measure_consensus_distance()
            row["comm/consensus_distance"] = self.consensus_distance
        self._metrics(self.step - 1, row)
        self._print_progress()

    def _apply_churn(self) -> None:
        if self.churn is None or self.round_index >= len(self.churn.events):
            return
        event = self.churn.events[self.round_index]
        for worker, source in event.joins.items():
            state_bytes = self.join_state_bytes(source)
            self.batches.restart(worker)  # a fresh process: its sampler starts afresh
            self.replicas.copy_worker(source, worker)
            self.rounds.join(worker, source, state_bytes)
            self.clocks.join(worker, source, state_bytes / (4 * self.replicas.numel))
            self.joins += 1
        self._live = list(event.live)

    def join_state_bytes(self, source: int) -> int:
        """Bytes a joiner pulls from ``source``, as the elastic mode sends them: the live point, the outer state
        (round start and anchor) and the inner optimizer state (AdamW: two moments and step counts), float32."""
        outer = getattr(self.rounds, "outer_state_copies", 2)
        return 4 * self.replicas.numel * (1 + outer) + self.replicas.optimizer_state_bytes(source)

    def _print_progress(self) -> None:
        if not self.progress_every or self.round_index % self.progress_every:
            return
        clock = f" sim_time={max(self.clocks.times()):.1f}s" if self.clocks.enabled else ""
        loss = self._last_train_loss
        log.info("round=%d step=%d/%d alive=%d/%d loss=%.4f%s wall=%.1fs", self.round_index, self.step,
                 self.max_steps, len(self._live), self.workers, loss, clock, time.perf_counter() - self._start)

    def _live_index(self) -> torch.Tensor:
        return torch.as_tensor(self._live, device=self.replicas.gather().device)

    @torch.no_grad()
    def consensus_point(self) -> torch.Tensor:
        """The average of the live replicas' points, (P,)."""
        index = self._live_index()
        return self.replicas.gather().index_select(0, index).sum(dim=0).div_(len(self._live))

    @torch.no_grad()
    def measure_consensus_distance(self) -> float:
        """(1/m) sum_i ||theta_i - mean theta||^2 over the live workers."""
        index = self._live_index()
        points = self.replicas.gather().index_select(0, index)
        return float((points - self.consensus_point()).pow(2).sum().double()) / len(self._live)

    @torch.no_grad()
    def replica_spread(self) -> dict[str, float]:
        """How far the live replicas are apart at a validation (a real run's per-worker ``val/loss_local`` lines,
        side by side): min, median and max of each replica's own loss on the first ``batch_size`` validation
        windows (one forward per replica: about a training step's forward), and the consensus distance."""
        x, y = next(self.batches.validation_batches(self.batches.batch_size))  # (S, T)
        flat = self.replicas.gather()
        losses = []
        for i in self._live:
            logits = functional_call(self.replicas.module, self.replicas.unflatten(flat[i]), (x,)).float()
            losses.append(float(F.cross_entropy(logits.flatten(0, 1), y.flatten())))  # (S, T, V) -> mean
        self.consensus_distance = self.measure_consensus_distance()
        return {"spread/val_loss_min": min(losses), "spread/val_loss_median": statistics.median(losses),
                "spread/val_loss_max": max(losses), "comm/consensus_distance": self.consensus_distance}

    def validation_stamps(self) -> dict[str, float]:
        """When a validation now would be stamped: the end of the consensus all-reduce (full model, float32) over
        the live workers, posted at their clocks and not waited on; ``{"": run's network, name: each network timed
        alongside}`` (empty without a clock)."""
        if not self.clocks.enabled:
            return {}
        stamp, *also = self.clocks.all_reduce_posted(self._live, None, 1.0)
        return {"": stamp, **dict(zip(self.clocks.also_names, also))}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Loss and perplexity of the consensus model on every worker's validation windows."""
        point = self.consensus_point()
        params = self.replicas.unflatten(point)
        total, tokens = 0.0, 0
        for x, y in self.batches.validation_batches(8 * self.batches.batch_size):
            logits = functional_call(self.replicas.module, params, (x,)).float()  # (S, T, V)
            total += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").double())
            tokens += y.numel()
        loss = total / tokens
        row = {"val/loss": loss, "val/ppl": math.exp(loss), "progress/tokens": float(self.tokens_seen),
               "progress/bytes_sent": self.bytes_sent_mean,
               "progress/wall_time_s": time.perf_counter() - self._start}
        for name, stamp in self.validation_stamps().items():
            row["val/sim_time" + (f"/{name}" if name else "")] = stamp
        row.update(self.replica_spread())
        self._metrics(self.step - 1, row)
        log.info("validation step=%d val_loss=%.4f", self.step, loss)
        return row
