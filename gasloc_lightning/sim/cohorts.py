"""Heterogeneous H_i: workers grouped into cohorts of equal H_i, each its own stack of replicas.

A worker with a smaller H_i computes but does not apply its last max(H) - H_i steps of a round
(as ``LocalStepsStrategy`` does), so its AdamW takes fewer steps and its bias corrections differ
from a faster worker's. Every cohort therefore keeps its own :class:`StackedReplicas` (its own
optimizer and step count); the learning-rate schedule steps every loop step in every cohort, as
Lightning steps it. The points of all workers are gathered, in worker order, into one ``(n, P)``
tensor for the round, and scattered back after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gasloc_lightning.sim.replicas import OptimizerFactory, StackedReplicas


class CohortReplicas:
    """n replicas whose inner steps per round H_i may differ.

    Args:
        module: the model of one worker (every replica's start).
        inner_steps: H_i of every worker (length n).
        optimizer_factory, lr_schedule, gradient_clip_val: as for :class:`StackedReplicas`.
    """

    def __init__(self, *, module: nn.Module, inner_steps: Sequence[int], optimizer_factory: OptimizerFactory,
                 lr_schedule: Callable[[int], float] | None = None, gradient_clip_val: float | None = None) -> None:
        if not inner_steps or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in inner_steps):
            raise ValueError(f"inner_steps (H_i) must be ints >= 1, one per worker, got {inner_steps!r}")
        self.module, self.inner_steps, self.workers = module, list(inner_steps), len(inner_steps)
        self.cohorts: list[tuple[int, Tensor, StackedReplicas]] = []
        for steps in sorted(set(inner_steps)):
            index = torch.tensor([i for i, h in enumerate(inner_steps) if h == steps])  # ids: stays on the host
            stack = StackedReplicas(module=module, workers=len(index), optimizer_factory=optimizer_factory,
                                    lr_schedule=lr_schedule, gradient_clip_val=gradient_clip_val)
            self.cohorts.append((steps, index, stack))
        first = self.cohorts[0][2].flat
        self.flat = torch.empty(self.workers, first.shape[1], device=first.device)  # (n, P) in worker order
        self.gather()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.cohorts[0][2].optimizer

    @property
    def lr(self) -> float:
        return self.cohorts[0][2].lr

    @property
    def round_length(self) -> int:
        return max(self.inner_steps)

    def applies(self, step_in_round: int) -> list[int]:
        """Workers whose optimizer step of this loop step is applied (step_in_round counts from 0)."""
        return [i for i, h in enumerate(self.inner_steps) if step_in_round < h]

    def train_step(self, x: Tensor, y: Tensor, step_in_round: int, rows: list[int] | None = None) -> Tensor:
        """One loop step of the workers in ``rows`` (default all): (m, B, T) batches -> (m,) losses; the others
        compute nothing."""
        rows = list(range(self.workers)) if rows is None else rows
        position = {worker: k for k, worker in enumerate(rows)}
        losses = torch.empty(len(rows), device=x.device)
        for steps, index, stack in self.cohorts:
            members = [(local, position[int(w)]) for local, w in enumerate(index.tolist()) if int(w) in position]
            if not members:
                stack.idle_step()
                continue
            batch = torch.as_tensor([k for _, k in members], device=x.device)
            local = [i for i, _ in members]
            losses[batch] = stack.step(x[batch], y[batch], apply=step_in_round < steps,
                                       rows=None if len(local) == stack.workers else local)
        return losses

    @property
    def numel(self) -> int:
        return self.cohorts[0][2].numel

    def optimizer_state_bytes(self, worker: int) -> int:
        stack, i = self._locate(worker)
        return stack.optimizer_state_bytes(i)

    @torch.no_grad()
    def gather(self) -> Tensor:
        """The cohorts' points into ``flat`` (worker order), before a round or an evaluation."""
        for _, index, stack in self.cohorts:
            self.flat[index] = stack.flat
        return self.flat

    @torch.no_grad()
    def scatter(self) -> None:
        """``flat`` back into the cohorts, after a round."""
        for _, index, stack in self.cohorts:
            stack.flat.copy_(self.flat[index])

    def unflatten(self, point: Tensor) -> dict[str, Tensor]:
        return self.cohorts[0][2].unflatten(point)

    def _locate(self, worker: int) -> tuple[StackedReplicas, int]:
        for _, index, stack in self.cohorts:
            hits = (index == worker).nonzero()
            if len(hits):
                return stack, int(hits[0])
        raise ValueError(f"worker {worker} is in no cohort")

    @torch.no_grad()
    def copy_worker(self, source: int, destination: int) -> None:
        """A joining worker takes its source's point and moments (its own cohort keeps its AdamW step count)."""
        source_stack, i = self._locate(source)
        destination_stack, j = self._locate(destination)
        destination_stack.flat[j].copy_(source_stack.flat[i])
        self.flat[destination].copy_(self.flat[source])
        pairs = zip(source_stack.optimizer.state.values(), destination_stack.optimizer.state.values())
        for source_state, destination_state in pairs:
            for key, value in source_state.items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    destination_state[key][j].copy_(value[i])

    def zero_nonfinite_state(self, worker: int) -> None:
        stack, i = self._locate(worker)
        stack.zero_nonfinite_state(i)

    def record(self) -> dict[str, Any]:
        return {"cohorts": {steps: len(index) for steps, index, _ in self.cohorts}}
