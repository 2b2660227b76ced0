"""Packing (input, target) documents into rows of `seq_len` with segment ids, positions and loss weights.

`packing` key:
- first_fit: grain's first-fit packer places whole documents into the first row with room; documents longer
  than a row are first cut into row-sized pieces (each its own segment, positions restarting at 0).
- concat: grain's concatenate-and-split: documents are laid end to end and rows cut every seq_len tokens; a
  document cut by a row boundary continues in the next row as a new segment.
- none: one document per row, trimmed to seq_len or padded.

Every document arrives already shifted (see tokenizer.EncodeDocument), so however rows are cut, an input's target
is the next token of its own document. Padding has segment id 0 and weight 0.
"""

from __future__ import annotations

import grain
import numpy as np

from maxctx.config import ConfigError, choices

PACKED = ("inputs", "targets")


class SplitLongDocuments(grain.experimental.FlatMapTransform):
    """Cuts a document into pieces of at most `seq_len` pairs, so first-fit never has to drop tokens."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.max_fan_out = 1  # unused by FlatMapIterDataset; set for grain's checks

    def flat_map(self, element: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        n = len(element["inputs"])
        if n <= self.seq_len:
            return [element]
        return [{k: v[s:s + self.seq_len] for k, v in element.items()} for s in range(0, n, self.seq_len)]


def to_row(element: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """grain's packed features -> the batch contract (one row)."""
    segment_ids = element["inputs_segment_ids"].astype(np.int32)
    return {"inputs": element["inputs"].astype(np.int32), "targets": element["targets"].astype(np.int32),
            "positions": element["inputs_positions"].astype(np.int32), "segment_ids": segment_ids,
            "weights": (segment_ids > 0).astype(np.float32)}


class PadOrTrim:
    """packing=none: one document per row."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def __call__(self, element: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = min(len(element["inputs"]), self.seq_len)
        row = {"inputs": np.zeros(self.seq_len, np.int32), "targets": np.zeros(self.seq_len, np.int32),
               "positions": np.zeros(self.seq_len, np.int32), "segment_ids": np.zeros(self.seq_len, np.int32),
               "weights": np.zeros(self.seq_len, np.float32)}
        row["inputs"][:n] = element["inputs"][:n]
        row["targets"][:n] = element["targets"][:n]
        row["positions"][:n] = np.arange(n)
        row["segment_ids"][:n] = 1
        row["weights"][:n] = 1.0
        return row


def pack(ds: grain.IterDataset, packing: str, seq_len: int, num_bins: int) -> grain.IterDataset:
    """Documents {'inputs', 'targets'} -> rows of the batch contract, per `packing`."""
    lengths = {key: seq_len for key in PACKED}
    if packing == "first_fit":
        ds = grain.experimental.FlatMapIterDataset(ds, SplitLongDocuments(seq_len))
        ds = grain.experimental.FirstFitPackIterDataset(ds, length_struct=lengths, num_packing_bins=num_bins,
                                                        shuffle_bins=False)
        return ds.map(to_row)
    if packing == "concat":
        return grain.experimental.ConcatThenSplitIterDataset(ds, length_struct=lengths).map(to_row)
    if packing == "none":
        return ds.map(PadOrTrim(seq_len))
    raise ConfigError(f"packing='{packing}' is not one of {', '.join(choices('packing'))}")
