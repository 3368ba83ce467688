"""HiddenRows: a batch's hiddens as rows of one device buffer, picked by a host index.

An engine holds its target's hiddens in one buffer (vLLM's and SGLang's [tokens, ...] hidden
states; the decode loop's verify rows) and knows on the host which row each sequence wants.
Passing ``HiddenRows(buffer, index)`` instead of a stacked tensor or a list of row views costs
no device work and no view per row: a captured chain gathers each row by its address
(cache/staging.py, ``ops/triton/rows.py``); elsewhere one ``index_select`` copies them.

Example
-------
>>> from draftgraph import HiddenRows                           # doctest: +SKIP
>>> rows = HiddenRows(hidden_states, np.array([3, 17, 40]))   # doctest: +SKIP
>>> prop.propose_batch(tokens, rows, positions, 3, states)     # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class HiddenRows:
    """Row i of the batch is ``tensor[index[i]]``.

    tensor : [R, *row] on the device, each row contiguous (its address is where a graph reads it).
    index : int64 [n] numpy array, each in [0, R).
    """

    tensor: torch.Tensor
    index: np.ndarray

    def __len__(self) -> int:
        return len(self.index)

    def take(self, rows: slice) -> HiddenRows:
        """The rows ``rows`` of this batch (a slice of the index, the same buffer)."""
        return HiddenRows(self.tensor, self.index[rows])

    def index_on_device(self) -> torch.Tensor:
        """The index as an int64 tensor on the buffer's device (a host-to-device copy off the CPU)."""
        index = torch.from_numpy(np.ascontiguousarray(self.index, dtype=np.int64))
        return index if self.tensor.device.type == "cpu" else index.to(self.tensor.device, non_blocking=True)

    def gather(self) -> torch.Tensor:
        """The rows as one new tensor [n, *row]."""
        return self.tensor.index_select(0, self.index_on_device())


def as_tensor(hiddens: torch.Tensor | HiddenRows) -> torch.Tensor:
    """A block of hiddens as one tensor: rows of a buffer gathered, a tensor as it is."""
    return hiddens.gather() if isinstance(hiddens, HiddenRows) else hiddens
