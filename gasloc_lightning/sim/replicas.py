"""n replicas of one model trained together in one process: the local phase of every worker at once.

The replicas' parameters are rows of one ``(n, P)`` float32 tensor (the stacked points theta_i the
outer step acts on), viewed per parameter as ``(n, *shape)`` leaves. The forward pass is
``torch.func.functional_call`` under ``vmap``, so each replica sees only its own batch and its own
weights. Per-worker AdamW is AdamW on the stacked leaves (it acts elementwise, and every replica of
one :class:`StackedReplicas` has taken the same number of steps, so the bias corrections agree); the
weight-decay groups are the real module's (:func:`gasloc_lightning.models.lm.parameter_groups`).
Gradient clipping is per replica, as Lightning clips each worker's own gradients: the norm of row i
is taken over all of replica i's parameters.

The forward and backward passes run over chunks of ``chunk_size`` replicas, each chunk's activations
freed before the next: at 256 replicas of the tiny GPT one pass over all of them at once is about
3x slower per replica than chunks of 8, whose activations stay in cache. Each replica's result is
the same either way (the replicas never interact).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

from gasloc_lightning.models.lm import parameter_groups

OptimizerFactory = Callable[[Iterable[Any]], torch.optim.Optimizer]


def _unique_named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters in ``module.parameters()`` order, tied ones once (as FlatLayout sends them)."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def parameter_count(module: nn.Module) -> int:
    """P: elements of one replica's trainable parameters (tied ones counted once)."""
    return sum(p.numel() for _, p in _unique_named_parameters(module))


class StackedReplicas:
    """``workers`` replicas of ``module``, their optimizer, learning-rate schedule and gradient clipping.

    Args:
        module: the model of one worker (its current weights are every replica's start).
        workers: n, replicas stacked along the leading dimension.
        optimizer_factory: builds the inner optimizer from parameter groups (a torch optimizer class
            or a partial, as the LanguageModel receives it); it must act elementwise (AdamW, SGD).
        lr_schedule: multiplier of the learning rate at optimizer step k (``LambdaLR``); None: constant.
        gradient_clip_val: clip each replica's gradient norm to this (Lightning's ``gradient_clip_val``).
        chunk_size: replicas per forward/backward pass (the last chunk may be smaller).
    """

    def __init__(
        self,
        *,
        module: nn.Module,
        workers: int,
        optimizer_factory: OptimizerFactory,
        lr_schedule: Callable[[int], float] | None = None,
        gradient_clip_val: float | None = None,
        chunk_size: int = 8,
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {workers!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        self.chunk_size = chunk_size
        if gradient_clip_val is not None and not gradient_clip_val > 0:
            raise ValueError(f"gradient_clip_val must be > 0 or None, got {gradient_clip_val!r}")
        self.module = module
        self.workers = workers
        self.gradient_clip_val = gradient_clip_val
        named = _unique_named_parameters(module)
        self.numel = sum(p.numel() for _, p in named)
        device = named[0][1].device if named else torch.device("cpu")  # the module's device: every tensor goes there
        self.flat = torch.empty(workers, self.numel, dtype=torch.float32, device=device)  # (n, P): row i is theta_i
        self.params: dict[str, nn.Parameter] = {}
        self._slices: dict[str, tuple[int, int, torch.Size]] = {}
        offset = 0
        for name, parameter in named:
            size = parameter.numel()
            view = self.flat[:, offset: offset + size].view(workers, *parameter.shape)  # (n, *shape)
            view.copy_(parameter.detach().to(torch.float32).expand_as(view))
            self.params[name] = nn.Parameter(view)  # shares the storage of self.flat
            self._slices[name] = (offset, size, parameter.shape)
            offset += size
        self.optimizer = optimizer_factory(self._stacked_groups(named))
        self.scheduler = None if lr_schedule is None else torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_schedule)
        self._loss_fn = vmap(self._replica_loss, in_dims=(0, 0, 0))

    def _stacked_groups(self, named: list[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
        by_id = {id(p): self.params[name] for name, p in named}
        groups = []
        for group in parameter_groups(self.module):
            stacked = dict(group)
            stacked["params"] = [by_id[id(p)] for p in group["params"] if id(p) in by_id]
            groups.append(stacked)
        return groups

    def _replica_loss(self, params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        logits = functional_call(self.module, params, (x,))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def unflatten(self, point: Tensor) -> dict[str, Tensor]:
        """One replica's flat (P,) point as ``{name: tensor}`` for ``functional_call``."""
        return {name: point[offset: offset + size].view(shape) for name, (offset, size, shape) in self._slices.items()}

    def applies(self, step_in_round: int) -> list[int]:
        """Workers whose step is applied: all of them (one H for every replica here)."""
        return list(range(self.workers))

    def train_step(self, x: Tensor, y: Tensor, step_in_round: int, rows: list[int] | None = None) -> Tensor:
        """One loop step of the replicas in ``rows`` (default all; the protocol
        :class:`~gasloc_lightning.sim.cohorts.CohortReplicas` shares): (m, B, T) batches -> (m,) losses."""
        return self.step(x, y, rows=rows)

    def gather(self) -> Tensor:
        """The (n, P) points (they live in ``flat`` already)."""
        return self.flat

    def scatter(self) -> None:
        """Nothing to do: ``flat`` is the parameters' storage."""

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _chunks(self, rows: list[int] | None = None) -> list[tuple[slice | Tensor, slice]]:
        """``(replica rows, batch rows)`` of every chunk: slices when every replica computes, an index of the
        computing replicas otherwise (down workers compute nothing)."""
        count = self.workers if rows is None else len(rows)
        spans = [slice(lo, min(lo + self.chunk_size, count)) for lo in range(0, count, self.chunk_size)]
        if rows is None or rows == list(range(self.workers)):
            return [(span, span) for span in spans]
        index = torch.as_tensor(rows, device=self.flat.device)
        chunks: list[tuple[slice | Tensor, slice]] = []
        for span in spans:  # a chunk of consecutive replicas is a view (no copy of its parameters)
            first, last = rows[span.start], rows[span.stop - 1]
            contiguous = last - first == span.stop - span.start - 1
            chunks.append((slice(first, last + 1) if contiguous else index[span], span))
        return chunks

    @torch.no_grad()
    def losses(self, x: Tensor, y: Tensor, rows: list[int] | None = None) -> Tensor:
        """Each replica's mean cross-entropy on its own batch: (m, B, T) ids and targets -> (m,), for the
        replicas in ``rows`` (default all)."""
        return torch.cat([self._loss_fn({name: p[part] for name, p in self.params.items()}, x[batch], y[batch])
                          for part, batch in self._chunks(rows)])

    def _backward(self, x: Tensor, y: Tensor, rows: list[int] | None = None) -> Tensor:
        """Losses and gradients, chunk by chunk: each chunk's gradients land in its rows of ``p.grad``; the rows
        of replicas that do not compute get zero gradients."""
        idle = None if rows is None else sorted(set(range(self.workers)) - set(rows))
        idle_index = torch.as_tensor(idle, device=self.flat.device) if idle else None
        for p in self.params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif idle_index is not None:  # replicas that compute nothing: no stale gradient of an earlier step
                p.grad.index_fill_(0, idle_index, 0.0)
        losses = torch.empty(self.workers if rows is None else len(rows), device=self.flat.device)
        for part, batch in self._chunks(rows):
            leaves = {name: p.detach()[part].requires_grad_() for name, p in self.params.items()}
            chunk = self._loss_fn(leaves, x[batch], y[batch])  # (rows,)
            # Replicas are independent: row i's gradient of the sum is that of loss i.
            grads = torch.autograd.grad(chunk.sum(), list(leaves.values()), allow_unused=True)
            for p, grad in zip(self.params.values(), grads):
                if grad is not None and isinstance(part, slice):
                    p.grad[part].copy_(grad)
                elif grad is not None:
                    p.grad.index_copy_(0, part, grad)
                elif isinstance(part, slice):
                    p.grad[part].zero_()
            losses[batch] = chunk.detach()
        return losses

    def step(self, x: Tensor, y: Tensor, apply: bool = True, rows: list[int] | None = None) -> Tensor:
        """One inner step of the replicas in ``rows`` (default all) on their own batches; returns their (m,) losses
        (detached).

        Replicas outside ``rows`` (down workers) compute nothing: no forward or backward pass, zero gradients.
        The optimizer still steps their rows (their parameters and moments decay under a zero gradient); nothing
        reads them before a join overwrites them with a live peer's.

        Args:
            x, y: (m, B, T) token ids and next-token targets, row k for replica ``rows[k]``.
            apply: False computes the losses only (a worker past its H_i in this round).
            rows: the computing replicas, in increasing order (None: all n).
        """
        if not apply:
            losses = self.losses(x, y, rows)
        else:
            losses = self._backward(x, y, rows)  # (m,); every row of every p.grad is written
            if self.gradient_clip_val is not None:
                self._clip_per_replica(self.gradient_clip_val)
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()  # Lightning steps the schedule every loop step
        return losses.detach()

    @torch.no_grad()
    def _clip_per_replica(self, max_norm: float) -> None:
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        squares = torch.stack([g.flatten(1).pow(2).sum(dim=1) for g in grads]).sum(dim=0)  # (n,)
        coefficient = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)  # as torch's clip_grad_norm_
        for g in grads:
            g.mul_(coefficient.view(-1, *([1] * (g.dim() - 1))))

    @torch.no_grad()
    def copy_worker(self, source: int, destination: int) -> None:
        """Replica ``destination`` takes ``source``'s parameters and optimizer state (a joining worker)."""
        self.flat[destination].copy_(self.flat[source])
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == self.workers:
                    value[destination].copy_(value[source])

    @torch.no_grad()
    def zero_nonfinite_state(self, worker: int) -> None:
        """Zero the non-finite entries of ``worker``'s optimizer state (a discarded round, as the strategy does)."""
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == self.workers:
                    torch.nan_to_num_(value[worker], nan=0.0, posinf=0.0, neginf=0.0)

    def optimizer_state_bytes(self, worker: int) -> int:
        """Bytes of one worker's inner optimizer state (its rows of the moments, and the shared step counts)."""
        total = 0
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == self.workers:
                    total += value[worker].numel() * value.element_size()
                elif isinstance(value, Tensor):
                    total += value.numel() * value.element_size()
        return total

    def idle_step(self) -> None:
        """A loop step in which none of these replicas computes: only the learning-rate schedule moves."""
        if self.scheduler is not None:
            self.scheduler.step()

    def state_bytes(self) -> int:
        """Bytes of the parameters, gradients and optimizer state held now."""
        total = self.flat.numel() * 4 * 2
        for state in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, Tensor))
        return total
