"""Byte-level data for GASLoC workers: each rank trains on its own shard of one token stream.

The default corpus is the source code of the Python standard library, which every Python
installation carries, so training and tests need no download. Any local text file or folder
works too, and ``source="hf:<name>"`` reads a Hugging Face dataset when the optional
``datasets`` package is installed.

Pipeline:

1. List the documents (files, or dataset records) and split them BY DOCUMENT: a document goes
   to validation iff a SHA-256 of its name falls in the ``val_fraction`` bucket, so the split
   never depends on the order of listing, on Python's salted ``hash()`` or on the world size.
   A single file is split by bytes instead: its last ``val_fraction`` goes to validation.
2. Fingerprint the content: SHA-256 over (name, SHA-256 of bytes) of every document, with the
   Python version for the standard library, since it differs between versions.
3. Concatenate each split into one file of raw bytes (token id = byte value, vocabulary 256),
   once, under ``cache_dir/<source>-<fingerprint key>/``, and memory-map it with
   ``torch.from_file``.
4. Rank r of W trains on the r-th contiguous 1/W of the train stream (disjoint shards), on
   windows of ``block_size + 1`` bytes at seeded random offsets; validation uses fixed,
   non-overlapping windows, the same number of batches on every rank.

Because the module shards by rank itself, Lightning must not add a DistributedSampler:
use ``Trainer(use_distributed_sampler=False)``.
"""

from __future__ import annotations

from gasloc_lightning.data.cache import byte_unigram_entropy
from gasloc_lightning.data.datamodule import ByteDataModule
from gasloc_lightning.data.sampling import RandomWindowSampler
from gasloc_lightning.data.sources import stdlib_source_files

__all__ = ["ByteDataModule", "RandomWindowSampler", "byte_unigram_entropy", "stdlib_source_files"]
