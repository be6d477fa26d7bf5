"""Memory-mapped token shards and deterministic sampling.

The batch for (seed, step, rank) is a pure function of those three numbers and the dataset, so a
restarted run needs only the step number to continue exactly where it left off.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kfp_nvrx.components.errors import UserError

# torch is imported where a batch is made: the launcher's preflight opens the dataset only to
# check it, and importing torch would cost it seconds.
if TYPE_CHECKING:
    import torch

INDEX_FILE = "index.json"


class TokenDataset:
    """A split of a dataset written by ``kfp-nvrx prepare-data``.

    Args:
        path: Dataset directory holding ``index.json`` and the shards.
        split: ``train`` or ``val``.
        field: Config key named in errors.
    """

    def __init__(self, path: str, split: str = "train", field: str = "data.path") -> None:
        from kfp_nvrx.components.data.shards import read_index

        root = Path(path)
        if not path or not os.path.lexists(root / INDEX_FILE):  # a FIFO there: read_index says
            raise UserError(field, f"{path!r} is not a dataset (no {INDEX_FILE}); "
                            "create one with `kfp-nvrx prepare-data`")
        self.index = read_index(root, field)
        if split not in self.index["splits"]:
            raise UserError(field, f"dataset has no {split!r} split")
        self.vocab_size = int(self.index["vocab_size"])
        dtype = np.dtype(self.index["dtype"])
        self.shards: list[np.memmap] = []
        for shard in self.index["splits"][split]["shards"]:
            file = root / shard["file"]
            try:
                arr = np.memmap(file, dtype=dtype, mode="r")
            except (OSError, ValueError) as err:
                raise UserError(field, f"cannot map shard {file}: {err}") from None
            if arr.shape[0] != shard["tokens"]:
                raise UserError(field, f"shard {file} has {arr.shape[0]} tokens, index says "
                                f"{shard['tokens']}; re-run prepare-data")
            self.shards.append(arr)
        self.sizes = np.array([s.shape[0] for s in self.shards], dtype=np.int64)
        self.tokens = int(self.sizes.sum())

    def check_fits(self, seq_len: int, vocab_size: int) -> None:
        """Raises UserError when windows don't fit or token ids exceed the model's vocabulary."""
        if self.vocab_size > vocab_size:
            raise UserError("model.vocab_size", f"{vocab_size} is smaller than the dataset's "
                            f"vocabulary ({self.vocab_size}); raise it or re-tokenize")
        if not self.shards or int(self.sizes.max()) < seq_len + 1:
            raise UserError("data.seq_len", f"{seq_len} + 1 tokens do not fit in any shard "
                            f"(largest has {int(self.sizes.max(initial=0))}); lower it")

    def batch(self, seed: int, step: int, rank: int, batch_size: int,
              seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (int64, shape ``(batch_size, seq_len)``) for one rank and step."""
        rng = np.random.default_rng([seed, step, rank])
        usable = np.maximum(self.sizes - seq_len, 0)
        shard_ids = rng.choice(len(self.shards), size=batch_size, p=usable / usable.sum())
        rows = []
        for sid in shard_ids:
            start = int(rng.integers(0, usable[sid]))
            rows.append(np.asarray(self.shards[sid][start:start + seq_len + 1], dtype=np.int64))
        import torch

        window = torch.from_numpy(np.stack(rows))
        return window[:, :-1], window[:, 1:]
