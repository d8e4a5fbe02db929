"""What the network may hand us: the one place that turns received bytes into state, and the run's secret.

A peer's state (a heal) arrives as bytes. :func:`load_state` loads them with ``torch.load(weights_only=True)``
onto the CPU, so a payload never runs code: a crafted pickle is refused with :class:`UnsafePayloadError`,
whoever signed it. Before that, the zip structure is parsed from the bytes (only stored entries, laid out as
torch.save writes them) before torch's reader is built, and the reader then confirms the records it would read
fit in the payload side by side: nothing inflates beyond the payload. Two checks then look at what was built:

- :func:`check_plain`: only dicts, lists and tuples of dense CPU tensors that own their data (no meta, sparse
  or quantized tensor) and plain data (None, bool, int, float, str) anywhere, with plain keys, each container
  reached once (no shared or cyclic references, but for tuples of plain data);
- :func:`check_like`: the exact structure of a reference this worker built itself (same keys, list lengths,
  tensor shapes and dtypes, finite floating tensors). The caller decides which subtrees it compares
  (e.g. the model's tensors always; an optimizer that has not stepped yet has no state to compare with).

:func:`sign` and :func:`verify` are the HMAC-SHA256 that tells members of a run (they know its secret, from
:func:`run_secret`) from anyone else who can reach a port. Nothing here imports Lightning or torchft.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import secrets
import struct
from typing import Any

import torch

SECRET_ENV = "GASLOC_ELASTIC_SECRET"
# Anyone who reaches a quorum's rendezvous store can list it and read the member-auth MACs: with them a weak secret
# can be guessed offline. The elastic strategies refuse a shorter one (new_secret makes 64 hex characters).
MIN_SECRET_BYTES = 16
PLAIN_TYPES = (type(None), bool, int, float, str)
MAX_KEY_CHARS = 1024  # longest dict key check_plain takes (a parameter's name is far shorter)
_SHOWN_KEY_CHARS = 40  # what an error message shows of one key


class UnsafePayloadError(ValueError):
    """Received bytes are not a state this worker may take: unsigned, unsafe to load, or off-shape."""


# ------------------------------------------------------------------ payloads
def dump_state(state: Any) -> bytes:
    """``torch.save`` of ``state`` into bytes (tensors on any device; :func:`load_state` loads to CPU)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def load_state(payload: bytes, *, max_bytes: int | None = None) -> Any:
    """Load bytes made by :func:`dump_state` without running any code they carry.

    Args:
        payload: the received bytes.
        max_bytes: refuse payloads longer than this (None: no limit).

    Raises:
        UnsafePayloadError: too long, not a torch archive whose records (as torch's own reader sees them) fit
            in the payload side by side, or holding objects that ``weights_only=True`` refuses (a pickle that
            would run code).
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise UnsafePayloadError(f"payload must be bytes, got {type(payload).__name__}")
    if max_bytes is not None and len(payload) > max_bytes:
        raise UnsafePayloadError(f"payload of {len(payload)} bytes exceeds max_bytes={max_bytes}")
    buffer = io.BytesIO(payload)
    _check_archive(buffer, len(payload))
    try:
        buffer.seek(0)
        return torch.load(buffer, weights_only=True, map_location="cpu")
    except Exception as error:  # UnpicklingError for a crafted pickle, RuntimeError for a torn archive...
        first = (str(error).splitlines() or [""])[0]
        raise UnsafePayloadError(f"payload refused by torch.load(weights_only=True): "
                                 f"{type(error).__name__}: {first}") from error


def _check_archive(buffer: io.BytesIO, length: int) -> None:
    # Python's zipfile and torch's reader (miniz) can read two different central directories from the same bytes
    # (zipfile finds it from where the end record sits, miniz from the offset the record states), and building
    # torch's reader already inflates two records in full (`version`, `.data/serialization_id`). So the zip
    # structure is parsed here first, strictly, from the bytes themselves (_check_zip_layout): only what
    # torch.save writes passes, and what passes cannot inflate. Torch's own reader then confirms, where this torch
    # can tell it, that the records it reads are the ones parsed.
    _check_zip_layout(buffer.getbuffer(), length)
    if not all(hasattr(torch._C.PyTorchFileReader, name) for name in ("get_record_size", "get_record_offset")):
        return  # an older torch cannot say where its records lie: the strict parse above decides alone
    try:
        reader = torch._C.PyTorchFileReader(buffer)
        records = sorted((reader.get_record_offset(name), reader.get_record_size(name), name)
                         for name in reader.get_all_records())
    except Exception as error:  # RuntimeError from miniz for anything that is not a torch zip archive
        first = (str(error).splitlines() or [""])[0]
        raise UnsafePayloadError(f"payload is not a torch archive: {type(error).__name__}: {first}") from error
    end = 0
    for offset, size, name in records:
        if offset < end or offset + size > length:
            raise UnsafePayloadError(
                f"payload's record {name[:80]!r} claims {size} bytes at offset {offset}, past the payload's "
                f"{length} bytes or into another record (a compressed or overlapping entry; torch.save writes none)")
        end = offset + size


_END = struct.Struct("<IHHHHIIH")  # end of central directory: 22 bytes
_END64_LOCATOR = struct.Struct("<IIQI")  # zip64 end locator: 20 bytes
_END64 = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory: 56 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory entry: 46 bytes + name, extra, comment
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local header: 30 bytes + name, extra
_SENTINEL16, _SENTINEL32 = 0xFFFF, 0xFFFFFFFF


def _check_zip_layout(data: memoryview, length: int) -> None:
    """The zip structure torch.save writes, and nothing else: one end record in the last 22 bytes (no comment;
    a zip64 end record and locator right before it when the archive needs them), a central directory that ends
    where they begin, and entries that are all stored (method 0, compressed size == size), unencrypted, whose
    local headers and data lie before the directory without overlapping. Then every record torch reads is at
    most its stored bytes, all of them together at most the payload."""
    def refuse(why: str) -> None:
        raise UnsafePayloadError(f"payload is not a torch archive as torch.save writes it: {why}")

    if length < _END.size:
        refuse(f"{length} bytes")
    signature, disk, directory_disk, on_disk, entries, size, offset, comment = _END.unpack_from(data, length - 22)
    if signature != 0x06054B50 or comment or disk or directory_disk or on_disk != entries:
        refuse("no end of central directory as the last 22 bytes (a comment, a second disk, or another record)")
    directory_end = length - 22
    locator_at = directory_end - _END64_LOCATOR.size
    if locator_at >= 0 and _END64_LOCATOR.unpack_from(data, locator_at)[0] == 0x07064B50:
        _, locator_disk, end64_at, disks = _END64_LOCATOR.unpack_from(data, locator_at)
        if locator_disk or disks != 1 or end64_at != locator_at - _END64.size or end64_at < 0:
            refuse("a zip64 locator that does not point right before itself")
        (signature, record_size, _, _, disk, directory_disk, on_disk64, entries64, size64,
         offset64) = _END64.unpack_from(data, end64_at)
        if (signature != 0x06064B50 or record_size != _END64.size - 12 or disk or directory_disk
                or on_disk64 != entries64):
            refuse("a zip64 end record that is not one plain record")
        for value, value64, sentinel in ((entries, entries64, _SENTINEL16), (size, size64, _SENTINEL32),
                                         (offset, offset64, _SENTINEL32)):
            if value != sentinel and value != value64:
                refuse("zip64 and 32-bit end records that disagree")
        entries, size, offset, directory_end = entries64, size64, offset64, end64_at
    if offset + size != directory_end:
        refuse(f"a central directory of {size} bytes at {offset} that does not end at its end record ({directory_end})")
    spans = []
    position = offset
    for _ in range(entries):
        if position + _CENTRAL.size > directory_end:
            refuse("a central directory shorter than its entry count")
        (signature, _, _, flags, method, _, _, _, compressed, uncompressed, name_length, extra_length,
         comment_length, disk, _, _, local_at) = _CENTRAL.unpack_from(data, position)
        extra_at = position + _CENTRAL.size + name_length
        after = extra_at + extra_length + comment_length
        if signature != 0x02014B50 or after > directory_end:
            refuse(f"no central directory entry at {position}")
        if _SENTINEL32 in (compressed, uncompressed, local_at) or disk == _SENTINEL16:
            uncompressed, compressed, local_at = _zip64_fields(data, extra_at, extra_length, uncompressed,
                                                               compressed, local_at, disk, refuse)
        if method != 0 or compressed != uncompressed or flags & 0x41:  # 0x1 encrypted, 0x40 strong encryption
            refuse(f"entry at {local_at}: method {method}, {compressed} bytes stored for {uncompressed} "
                   "(a compressed or encrypted entry; torch.save stores every record)")
        if local_at + _LOCAL.size > offset:
            refuse(f"a local header at {local_at} past the central directory")
        signature, *_, local_name, local_extra = _LOCAL.unpack_from(data, local_at)
        data_end = local_at + _LOCAL.size + local_name + local_extra + compressed
        if signature != 0x04034B50 or data_end > offset:
            refuse(f"entry at {local_at}: no local header, or data past the central directory")
        spans.append((local_at, data_end))
        position = after
    if position != directory_end:
        refuse("a central directory longer than its entries")
    spans.sort()
    for (_, first_end), (second_start, _) in zip(spans, spans[1:]):
        if second_start < first_end:
            refuse(f"entries that overlap at {second_start}")


def _zip64_fields(data, at, length, uncompressed, compressed, local_at, disk, refuse):
    # The zip64 extended information field (id 1) holds, in this order, only the values whose 32-bit field is the
    # sentinel: size, compressed size, local header offset, disk.
    end = at + length
    while at + 4 <= end:
        tag, size = struct.unpack_from("<HH", data, at)
        if tag == 1:
            values = iter(struct.unpack_from(f"<{size // 8}Q", data, at + 4)) if at + 4 + size <= end else iter(())
            try:
                if uncompressed == _SENTINEL32:
                    uncompressed = next(values)
                if compressed == _SENTINEL32:
                    compressed = next(values)
                if local_at == _SENTINEL32:
                    local_at = next(values)
            except StopIteration:
                refuse("a zip64 field shorter than its sentinels")
            if disk == _SENTINEL16:
                refuse("an entry on another disk")
            return uncompressed, compressed, local_at
        at += 4 + size
    refuse("32-bit sentinels with no zip64 field")


# ------------------------------------------------------------------ structure checks
def check_plain(state: Any, *, path: str = "state", finite: bool = True) -> None:
    """Check that ``state`` holds only dicts, lists and tuples of tensors and plain data.

    Args:
        state: a loaded state.
        path: the name of ``state`` in error messages.
        finite: also require floating tensors to be finite. Plain floats may be infinite either way
            (``ReduceLROnPlateau`` keeps ``mode_worse=inf``).

    Raises:
        UnsafePayloadError: naming the first offending path (each key cut to 40 characters), or a dict key
            longer than :data:`MAX_KEY_CHARS`.

    A path is kept as a link to its parent's and rendered only in an error: a payload may share one long key
    (torch.save memoizes it) among many entries, and building every path string eagerly would cost that key's
    length per entry (issue 34's path bomb: 0.27 MB to 256 MB). So memory stays proportional to the payload.
    """
    for leaf_path, leaf in _leaves(state, _Path(None, path)):
        _check_leaf(leaf_path, leaf, finite)


def check_like(received: Any, reference: Any, *, path: str = "state", finite: bool = True) -> None:
    """Check that ``received`` has the exact structure of ``reference``, a state this worker built itself.

    Same dict keys, list and tuple lengths; tensors where the reference has tensors, with the same shape
    and dtype; plain data where it has plain data (values and their types may differ: a learning rate may be
    an int on one worker and a float on another).

    Args:
        received: the state a peer sent (already through :func:`load_state`).
        reference: the local state of the same shape.
        path: the name of ``received`` in error messages, e.g. ``"user.default.live"``.
        finite: also require received floating tensors to be finite.

    Raises:
        UnsafePayloadError: naming the first differing path,
            e.g. ``user.default.live: shape (10,) expected (12,)``.
    """
    stack = [(path, received, reference)]
    while stack:
        here, got, want = stack.pop()
        _check_same_kind(here, got, want)
        if isinstance(want, dict):
            stack.extend((f"{here}.{key}", got[key], want[key]) for key in reversed(list(want)))
        elif isinstance(want, (list, tuple)):
            stack.extend((f"{here}.{index}", got[index], want[index]) for index in reversed(range(len(want))))
        else:
            _check_leaf(here, got, finite)


def _check_same_kind(path: str, got: Any, want: Any) -> None:
    if isinstance(want, dict):
        if not isinstance(got, dict):
            raise UnsafePayloadError(f"{path}: {type(got).__name__} expected a dict")
        missing, extra = [k for k in want if k not in got], [k for k in got if k not in want]
        if missing or extra:
            raise UnsafePayloadError(f"{path}: keys differ, missing {missing[:5]} unexpected {extra[:5]}")
    elif isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            raise UnsafePayloadError(f"{path}: {_describe(got)} expected a sequence of length {len(want)}")
    elif isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise UnsafePayloadError(f"{path}: {type(got).__name__} expected a tensor")
        if tuple(got.shape) != tuple(want.shape):
            raise UnsafePayloadError(f"{path}: shape {tuple(got.shape)} expected {tuple(want.shape)}")
        if got.dtype != want.dtype:
            raise UnsafePayloadError(f"{path}: dtype {got.dtype} expected {want.dtype}")
    elif type(got) not in PLAIN_TYPES:
        raise UnsafePayloadError(f"{path}: {type(got).__name__} expected plain data")


class _Path:
    """A path in a state, as a link to its parent: rendered (keys cut short) only when an error names it."""

    __slots__ = ("parent", "key")

    def __init__(self, parent: _Path | None, key: Any) -> None:
        self.parent, self.key = parent, key

    def __str__(self) -> str:
        parts, link = [], self
        while link is not None:
            text = str(link.key)
            parts.append(text if len(text) <= _SHOWN_KEY_CHARS else text[:_SHOWN_KEY_CHARS] + "...")
            link = link.parent
        return ".".join(reversed(parts))


def _leaves(state: Any, path: _Path):
    # Iterative so that a deeply nested payload fails a check instead of the interpreter's recursion limit.
    # torch.save keeps shared references and torch.load(weights_only=True) rebuilds them, so a payload of a few KB
    # can be a graph of 2^60 paths (each list holding the previous one twice) or a list that holds itself: a walk
    # that keeps no record of what it visited never ends. Every container is therefore walked once. One seen a
    # second time is refused, except a tuple of plain data only (an optimizer's param groups share the one
    # `betas` tuple of its defaults): it holds no container, so sharing it cannot multiply anything, and it was
    # already checked, so it is skipped.
    # The walk keeps one iterator per open container (memory grows with depth, not with the number of entries),
    # and plain entries, which always pass, are skipped without a path link of their own.
    seen: set[int] = set()
    flat: set[int] = set()
    stack: list[tuple[_Path, Any, Any]] = []  # (path of a container, the container, an iterator over its keys)

    def enter(here: _Path, node: Any) -> Any:  # a leaf to yield, or None (a container: now on the stack)
        if not isinstance(node, (dict, list, tuple)):
            return node
        if id(node) in seen:
            if id(node) in flat:
                return None
            raise UnsafePayloadError(f"{here}: a {type(node).__name__} reached a second time (a shared or "
                                     "cyclic reference, which a worker's state holds only as tuples of plain data)")
        seen.add(id(node))
        if isinstance(node, dict):
            for key in node:
                if type(key) not in PLAIN_TYPES:
                    raise UnsafePayloadError(f"{here}: key of type {type(key).__name__}, expected plain data")
                if type(key) is str and len(key) > MAX_KEY_CHARS:
                    raise UnsafePayloadError(f"{here}: a key of {len(key)} characters (at most {MAX_KEY_CHARS})")
            stack.append((here, node, iter(list(node))))
        else:
            if type(node) is tuple and all(type(item) in PLAIN_TYPES for item in node):
                flat.add(id(node))
            stack.append((here, node, iter(range(len(node)))))
        return None

    if not isinstance(state, (dict, list, tuple)):
        yield path, state
        return
    enter(path, state)
    while stack:
        here, node, keys = stack[-1]
        key = next(keys, _WALK_END)
        if key is _WALK_END:
            stack.pop()
            continue
        item = node[key]
        if type(item) in PLAIN_TYPES:
            continue
        link = _Path(here, key)
        if enter(link, item) is not None:
            yield link, item


_WALK_END = object()


def _check_leaf(path: str | _Path, leaf: Any, finite: bool) -> None:
    if type(leaf) in PLAIN_TYPES:
        return
    if type(leaf) not in (torch.Tensor, torch.nn.Parameter) or leaf.layout != torch.strided:
        raise UnsafePayloadError(f"{path}: {_describe(leaf)} is neither a dense tensor nor plain data")
    if leaf.device.type != "cpu" or leaf.is_quantized:
        # a meta tensor is a shape with no data (2^40 elements cost nothing to send, and pass every value check);
        # load_state maps to the CPU, so any other device is a tensor that did not come from it
        raise UnsafePayloadError(f"{path}: tensor on device {leaf.device.type}"
                                 f"{' (quantized)' if leaf.is_quantized else ''}; only CPU tensors with data are taken")
    if not leaf.is_contiguous() or leaf.storage_offset() or (
            leaf.untyped_storage().nbytes() != leaf.numel() * leaf.element_size()):
        # e.g. a stride-0 "expanded" tensor: a few stored bytes that claim any shape (an optimizer step on it
        # raises, and checking it allocates the claimed size); a state a worker saves owns its storage
        raise UnsafePayloadError(f"{path}: tensor of shape {tuple(leaf.shape)} does not own a dense storage")
    if finite and (leaf.is_floating_point() or leaf.is_complex()) and not bool(torch.isfinite(leaf).all()):
        raise UnsafePayloadError(f"{path}: tensor holds non-finite values")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor(layout={value.layout}, device={value.device.type}, type={type(value).__name__})"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of length {len(value)}"
    return type(value).__name__


# ------------------------------------------------------------------ authentication
def sign(secret: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 (hex) of ``parts`` under ``secret``.

    Each part is length-prefixed, so ``("ab", "c")`` and ``("a", "bc")`` sign differently.
    """
    if not isinstance(secret, bytes) or not secret:
        raise ValueError("secret must be non-empty bytes")
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for index, part in enumerate(parts):
        if not isinstance(part, bytes):
            raise ValueError(f"parts[{index}] must be bytes, got {type(part).__name__}")
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.hexdigest()


def verify(secret: bytes, mac: str | None, *parts: bytes) -> bool:
    """Whether ``mac`` is :func:`sign` of ``parts`` under ``secret``; compared in constant time."""
    if not isinstance(mac, str):
        return False
    # Bytes, not str: compare_digest refuses non-ASCII strings, and a header may hold anything.
    return hmac.compare_digest(sign(secret, *parts).encode(), mac.encode("utf-8", "surrogateescape"))


def run_secret(value: str | None = None) -> bytes | None:
    """The run's secret: ``value`` if given, else the variable ``GASLOC_ELASTIC_SECRET``, else None.

    Every member of a run must be given the same secret (e.g. one :func:`new_secret` shared by the launcher).
    """
    if value is None:
        value = os.environ.get(SECRET_ENV) or None
        if value is None:
            return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"value must be a non-empty str or None (else {SECRET_ENV} is read)")
    return value.encode("utf-8")


def new_secret() -> str:
    """A fresh random secret for a run (64 hex characters, 256 bits)."""
    return secrets.token_hex(32)
