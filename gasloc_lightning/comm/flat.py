"""FlatLayout: the exchanged tensors of a module as one flat float32 vector that the module lives in.

The message of one round is ``[ trainable parameters | exchanged buffers ]``. Parameters get the
outer step; exchanged buffers (BatchNorm statistics) are mixed without momentum.

Which tensors are exchanged:

- trainable parameters, tied ones once; frozen parameters stay local;
- floating buffers that are persistent (in ``state_dict``) and finite when the layout is built.
  Non-persistent buffers (caches, rotary tables) and buffers holding +-inf or NaN by design
  (additive causal masks filled with -inf) are never exchanged, guarded or repaired: mixing two
  -inf gives NaN, and "repairing" a mask zeroes it. Integer buffers stay local.

When every exchanged tensor is float32 on one device, the layout *binds* them: each tensor's
``.data`` becomes a view into one contiguous buffer (as DDP's bucket views and FSDP's flat
parameters do). The optimizer keeps holding the same ``Parameter`` objects, and a round reads and
writes the model in place, with no gather and no scatter copy. Otherwise (bfloat16-true
parameters, say) the layout gathers into a float32 scratch vector and scatters back, casting.

A module sharded with FSDP2 (``fully_shard``, parameters are ``DTensor``) is laid out by the shard
this rank holds: the vector is ``[ local parameter shards | buffers ]``, 1/k of the parameters on
each of a worker's k ranks. FSDP2 keeps the shards in storage of its own (it all-gathers from it), so
such a layout never binds: it copies the local shards in and out, and after writing them it reshards
every FSDP module, since a module that kept its parameters unsharded after a forward (FSDP2's root
does, in evaluation) would otherwise run its next forward on the old values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from gasloc_lightning.algorithm.outer import all_finite
from gasloc_lightning.algorithm.streaming import fragment_bounds


def local_tensor(tensor: Tensor) -> Tensor:
    """The part of ``tensor`` this rank holds: a ``DTensor``'s local shard (FSDP2 updates it in place, so it is
    the live storage), else the tensor's data."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor.data


def _cumulative(sizes: Iterable[int]) -> list[int]:
    total, ends = 0, []
    for size in sizes:
        total += size
        ends.append(total)
    return ends


def _unique(tensors: Iterable[Tensor]) -> list[Tensor]:
    seen: set[int] = set()
    unique = []
    for tensor in tensors:
        if id(tensor) not in seen:  # tied weights appear twice in named_parameters(remove_duplicate=False)
            seen.add(id(tensor))
            unique.append(tensor)
    return unique


def exchanged_buffers(module: nn.Module) -> list[Tensor]:
    """The floating buffers a round exchanges: persistent ones that are finite now."""
    persistent = {id(t) for t in module.state_dict(keep_vars=True).values()}
    return _unique(
        b for b in module.buffers() if torch.is_floating_point(b) and id(b) in persistent and all_finite(b)
    )


class FlatLayout:
    """A fixed order of a module's exchanged tensors and their offsets in one flat float32 vector.

    Args:
        module: the model whose trainable parameters and exchanged buffers form the message.
        bind: store the exchanged tensors in the flat vector itself when they are all float32
            on one device (see the module docstring).
    """

    def __init__(self, module: nn.Module, bind: bool = True):
        self._fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for fsdp_module in self._fsdp_modules:  # its parameters are the sharded ones only while resharded
            fsdp_module.reshard()
        self.parameters = _unique(p for p in module.parameters() if p.requires_grad)
        if not self.parameters:
            raise ValueError("the model has no trainable parameters to exchange")
        self.buffers = exchanged_buffers(module)
        self.sharded = any(isinstance(p, DTensor) for p in self.parameters)
        self.num_parameter_elements = sum(local_tensor(p).numel() for p in self.parameters)
        self.num_buffer_elements = sum(b.numel() for b in self.buffers)
        self._tensors = self.parameters + self.buffers
        self.device = local_tensor(self.parameters[0]).device
        self._signature = self._describe(module)
        self._flat = self.new_buffer()
        self.bound = bind and not self.sharded and all(
            t.dtype == torch.float32 and t.device == self.device for t in self._tensors)
        if self.bound:
            self._bind()

    @property
    def numel(self) -> int:
        return self.num_parameter_elements + self.num_buffer_elements

    def _describe(self, module: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
        exchanged = {id(t) for t in self._tensors}
        named = list(module.named_parameters()) + list(module.named_buffers())
        return [(name, tuple(t.shape), str(t.dtype)) for name, t in named if id(t) in exchanged]

    def signature(self) -> list[tuple[str, tuple[int, ...], str]]:
        """Names, shapes and dtypes of the exchanged tensors, to compare models across ranks."""
        return list(self._signature)

    def signature_digest(self) -> int:
        """A 63-bit hash of :meth:`signature`: ranks compare integers, never unpickle each other's bytes."""
        digest = hashlib.sha256(repr(self._signature).encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    def new_buffer(self) -> Tensor:
        return torch.empty(self.numel, dtype=torch.float32, device=self.device)

    @staticmethod
    def _views(flat: Tensor, tensors: list[Tensor]) -> list[Tensor]:
        views, offset = [], 0
        for tensor in tensors:
            tensor = local_tensor(tensor)
            views.append(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
        return views

    def _data(self, tensors: list[Tensor]) -> list[Tensor]:
        return [local_tensor(t) for t in tensors]

    @torch.no_grad()
    def _bind(self) -> None:
        views = self._views(self._flat, self._tensors)
        torch._foreach_copy_(views, [t.data for t in self._tensors])
        for tensor, view in zip(self._tensors, views):
            tensor.data = view

    def is_live(self, flat: Tensor) -> bool:
        """Whether ``flat`` is the vector the module lives in (writing it changes the model)."""
        return self.bound and flat.data_ptr() == self._flat.data_ptr()

    @torch.no_grad()
    def read(self) -> Tensor:
        """The current point ``[ parameters | buffers ]``: the live vector when bound (no copy), else a
        float32 copy in a scratch vector that the next ``read`` overwrites."""
        if not self.bound:
            torch._foreach_copy_(self._views(self._flat, self._tensors), self._data(self._tensors))
        return self._flat

    @torch.no_grad()
    def gather(self, out: Tensor) -> Tensor:
        """Copy every exchanged live tensor into ``out`` (cast to float32)."""
        if self.bound:
            return out.copy_(self._flat)
        torch._foreach_copy_(self._views(out, self._tensors), self._data(self._tensors))
        return out

    @torch.no_grad()
    def scatter(self, flat: Tensor) -> None:
        """Copy a full flat vector (parameters and buffers) into the live tensors."""
        if self.bound:
            if not self.is_live(flat):
                self._flat.copy_(flat)
            return
        self._copy_into(self._tensors, flat)

    @torch.no_grad()
    def scatter_parameters(self, flat_parameters: Tensor) -> None:
        """Copy the parameter part only (cast to each parameter's dtype)."""
        if self.bound:
            live, _ = self.split(self._flat)
            if live.data_ptr() != flat_parameters.data_ptr():
                live.copy_(flat_parameters)
            return
        self._copy_into(self.parameters, flat_parameters)

    @torch.no_grad()
    def scatter_buffers(self, flat_buffers: Tensor) -> None:
        if self.bound:
            _, live = self.split(self._flat)
            if live.numel() and live.data_ptr() != flat_buffers.data_ptr():
                live.copy_(flat_buffers)
            return
        self._copy_into(self.buffers, flat_buffers)

    def _copy_into(self, tensors: list[Tensor], flat: Tensor) -> None:
        if tensors:
            torch._foreach_copy_(self._data(tensors), self._views(flat, tensors))
        for module in self._fsdp_modules:  # the next forward gathers the new shards
            module.reshard()

    def fragment_bounds(self, fragments: int) -> list[tuple[int, int]]:
        """F contiguous fragments of the parameter part, as element offsets in this layout's vector.

        The cuts lie between whole tensors chosen by the tensors' whole sizes (not their shards'), so every
        shard of a sharded worker, and an unsharded replica, cut between the same parameters.
        """
        whole = fragment_bounds([p.numel() for p in self.parameters], fragments)
        offsets, local = {0: 0}, 0
        for p, end in zip(self.parameters, _cumulative(p.numel() for p in self.parameters)):
            local += local_tensor(p).numel()
            offsets[end] = local
        bounds = [(offsets[start], offsets[end]) for start, end in whole]
        empty = [f for f, (start, end) in enumerate(bounds) if start == end]
        if empty:
            raise ValueError(f"fragments={fragments}: fragment(s) {empty} hold no element of this rank's shard (tensors "
                             "smaller than the shard count); use fewer fragments")
        return bounds

    def split(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """The parameter and buffer parts of a flat vector (views)."""
        return flat[: self.num_parameter_elements], flat[self.num_parameter_elements :]
