"""Keyed tags over the bytes of every gossip message and all-reduce chunk: a message is used only if its
sender knew the run's secret.

The tag of a message is a hash list: each ``leaf_bytes`` piece of its bytes gets a keyed hash (the pieces
are hashed on a few threads; ``hashlib`` releases the GIL), and the tag is a keyed hash of the context, the
byte count and the ordered leaf hashes. The context binds the tag to one use (quorum id, round or collective,
sender and receiver member ids, ring step), so a recorded message cannot be replayed elsewhere, and the leaf
hashes are computed once per message however many peers receive it. The key is derived from the run's secret
for this use only (it never signs a heal or a member's attestation).

Two keyed hashes from the standard library: ``sha256`` (HMAC-SHA256, hardware-accelerated on CPUs with SHA
extensions: about twice BLAKE2b's speed on the machine of ``benchmarks/message_auth.py``) and ``blake2b``
(keyed BLAKE2b-256). Both give 32-byte tags. What it costs per round: ``docs/security.md``.

Nothing here imports Lightning or talks to a process group (the transport does).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

__all__ = ["TAG_BYTES", "MessageAuthenticator", "TagBuilder", "context"]

TAG_BYTES = 32
ALGORITHMS = ("sha256", "blake2b")
_LABEL = b"gasloc message-auth v1"


def context(*parts: object) -> bytes:
    """An unambiguous byte string of ``parts`` (ints and strs, each length-prefixed): a tag's use."""
    out = bytearray()
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, (int, str, bytes)):
            raise ValueError(f"context parts must be int, str or bytes, got {type(part).__name__}")
        data = part if isinstance(part, bytes) else str(part).encode()
        out += len(data).to_bytes(4, "big") + data
    return bytes(out)


class MessageAuthenticator:
    """Tags a message's bytes with a key only the run's members hold, and checks received tags.

    Args:
        secret: the run's secret (``GASLOC_ELASTIC_SECRET``); a key for this use is derived from it.
        algorithm: ``"sha256"`` (HMAC-SHA256) or ``"blake2b"`` (keyed BLAKE2b-256).
        leaf_bytes: bytes per hashed piece (a multiple of 4: a float32 element is never split).
        threads: hashing threads (``None``: up to 4, at most the CPUs).
    """

    def __init__(self, secret: bytes, *, algorithm: str = "sha256", leaf_bytes: int = 4 << 20,
                 threads: int | None = None) -> None:
        if not isinstance(secret, bytes) or not secret:
            raise ValueError("secret must be non-empty bytes (the run's secret; see docs/security.md)")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if isinstance(leaf_bytes, bool) or not isinstance(leaf_bytes, int) or leaf_bytes < 4 or leaf_bytes % 4:
            raise ValueError(f"leaf_bytes must be a positive multiple of 4, got {leaf_bytes!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be None or an int >= 1, got {threads!r}")
        self.algorithm, self.leaf_bytes = algorithm, leaf_bytes
        self.threads = threads if threads is not None else max(1, min(4, os.cpu_count() or 1))
        self._key = hmac.new(secret, _LABEL, hashlib.sha256).digest()
        self._pool: ThreadPoolExecutor | None = None

    def _mac(self, data: memoryview | bytes) -> bytes:
        if self.algorithm == "sha256":
            return hmac.digest(self._key, data, "sha256")
        return hashlib.blake2b(data, key=self._key, digest_size=TAG_BYTES).digest()

    def builder(self) -> TagBuilder:
        """An incremental tag over a message streamed in pieces (see :class:`TagBuilder`)."""
        return TagBuilder(self)

    def leaves(self, message: Tensor) -> tuple[int, list[bytes]]:
        """The byte count and leaf hashes of ``message`` (hashed once; :meth:`seal` binds them to a use)."""
        builder = self.builder()
        builder.update(message)
        return builder.num_bytes, builder.leaf_hashes

    def seal(self, leaves: tuple[int, Sequence[bytes]], use: bytes) -> bytes:
        """The tag of a message with these ``leaves`` for ``use`` (a :func:`context`)."""
        num_bytes, hashes = leaves
        return self._mac(b"".join([context(use, num_bytes, len(hashes)), *hashes]))

    def tag(self, message: Tensor, use: bytes) -> bytes:
        """The 32-byte tag of ``message``'s bytes for ``use``."""
        return self.seal(self.leaves(message), use)

    def verify(self, message: Tensor, use: bytes, tag: bytes | Tensor) -> bool:
        """Whether ``tag`` is ``message``'s tag for ``use`` (compared in constant time)."""
        if isinstance(tag, Tensor):
            tag = tag_bytes(tag)
        return hmac.compare_digest(self.tag(message, use), tag)

    def _hash_leaves(self, data: memoryview) -> list[bytes]:
        pieces = [data[start:start + self.leaf_bytes] for start in range(0, len(data), self.leaf_bytes)]
        if len(pieces) <= 1 or self.threads == 1:
            return [self._mac(piece) for piece in pieces]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="message-auth")
        return list(self._pool.map(self._mac, pieces))

    def close(self) -> None:
        """Stop the hashing threads (a later tag starts them again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class TagBuilder:
    """A tag over a message fed in pieces (a 4 GB message streamed through one reused buffer): every piece
    but the last must be a whole number of ``leaf_bytes``, so the tag equals that of the whole message."""

    def __init__(self, authenticator: MessageAuthenticator) -> None:
        self._auth = authenticator
        self.num_bytes = 0
        self.leaf_hashes: list[bytes] = []
        self._closed = False

    def update(self, piece: Tensor) -> None:
        if self._closed:
            raise ValueError("piece after a last piece that was not a whole number of leaf_bytes")
        data = _bytes_of(piece)
        self.leaf_hashes.extend(self._auth._hash_leaves(data))
        self.num_bytes += len(data)
        self._closed = len(data) % self._auth.leaf_bytes != 0

    def seal(self, use: bytes) -> bytes:
        return self._auth.seal((self.num_bytes, self.leaf_hashes), use)


def _bytes_of(tensor: Tensor) -> memoryview:
    """The bytes of a tensor: without a copy for a contiguous CPU tensor (else one copy on the CPU)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        tensor = tensor.detach().to("cpu", memory_format=torch.contiguous_format)
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def tag_tensor(tag: bytes) -> Tensor:
    """A tag as the uint8 tensor that travels on the process group."""
    return torch.frombuffer(bytearray(tag), dtype=torch.uint8)


def tag_bytes(tensor: Tensor) -> bytes:
    return bytes(tensor.to(torch.uint8).numpy().tobytes())
