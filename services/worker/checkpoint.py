"""What a checkpoint holds, read lazily: ``CheckpointTensor`` (one tensor, sliced on demand),
``LoadReport`` (how much of each tensor was read) and ``iterate_weights`` (every tensor of a model
folder's ``*.safetensors`` or ``pytorch_model*.bin``).

Model layers (``load_weights``), the quantization readers and weight sync take these types; the
loader, which builds models, uses them too. Kept apart from ``loader`` so that those modules never
import the loader (which imports them): no import cycle.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from gridserve.shared.errors import ModelNotFoundError


class CheckpointTensor:
    """One checkpoint tensor, read lazily: a tensor-parallel layer reads only its rows or columns.

    Backed by a safetensors slice (``safe_open(...).get_slice``: only the requested bytes are read)
    or by an already-loaded tensor (``pytorch_model.bin``). Every read is recorded in ``report``.
    """

    def __init__(self, name: str, shape: tuple[int, ...], read: Callable[[tuple], torch.Tensor],
                 report: LoadReport, record_as: Optional[tuple[str, int]] = None) -> None:
        self.name = name
        self.shape = shape
        self._read = read
        self._report = report
        # a view of another tensor (``row_block``, ``transposed``) counts its reads against that one
        self._record_as = record_as or (name, math.prod(shape))

    def full(self) -> torch.Tensor:
        return self._take(tuple(slice(None) for _ in self.shape))

    def rows(self, start: int, end: int) -> torch.Tensor:
        """``tensor[start:end]`` (dim 0)."""
        return self._take((slice(start, end),) + tuple(slice(None) for _ in self.shape[1:]))

    def cols(self, start: int, end: int) -> torch.Tensor:
        """``tensor[:, start:end]`` (dim 1)."""
        return self._take((slice(None), slice(start, end)))

    def narrow(self, dim: int, start: int, end: int) -> torch.Tensor:
        """``start:end`` along ``dim``, whole along the others (a TP slice of stacked expert weights)."""
        return self._take(tuple(slice(start, end) if d == dim else slice(None) for d in range(len(self.shape))))

    def row_block(self, start: int, end: int) -> CheckpointTensor:
        """Rows ``start:end`` as a tensor of their own, still read lazily (one part of a pre-fused
        projection: a tensor-parallel rank then reads only its rows of that part)."""

        def read(index: tuple) -> torch.Tensor:
            rows = index[0].indices(end - start)
            return self._read((slice(start + rows[0], start + rows[1]),) + tuple(index[1:]))

        return CheckpointTensor(self.name, (end - start, *self.shape[1:]), read, self._report, self._record_as)

    def transposed(self) -> CheckpointTensor:
        """The 2-D tensor transposed (a checkpoint that stores ``(in, out)``, GPT-2's Conv1D)."""
        return CheckpointTensor(self.name, (self.shape[1], self.shape[0]),
                                lambda index: self._read((index[1], index[0])).t(), self._report, self._record_as)

    def materialized(self, tensor: torch.Tensor) -> CheckpointTensor:
        """``tensor`` (this one, read whole and rearranged) in this tensor's place."""
        return CheckpointTensor(self.name, tuple(tensor.shape), lambda index: tensor[index], self._report,
                                self._record_as)

    def _take(self, index: tuple) -> torch.Tensor:
        tensor = self._read(index)
        self._report.record(*self._record_as[:1], tensor.numel(), self._record_as[1])
        return tensor


@dataclass
class LoadReport:
    """Elements read of every checkpoint tensor: proof that a rank read only its shards."""

    read: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (elements read, total)

    def record(self, name: str, elements: int, total: int) -> None:
        done, _ = self.read.get(name, (0, total))
        self.read[name] = (done + elements, total)

    def fraction(self, name: str) -> float:
        done, total = self.read[name]
        return done / total if total else 1.0

    def max_fraction(self, names: Iterable[str]) -> float:
        return max((self.fraction(n) for n in names), default=0.0)


def iterate_weights(model_path: str | Path, report: Optional[LoadReport] = None) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield ``(name, CheckpointTensor)`` from ``*.safetensors`` (sharded or not) or ``pytorch_model*.bin``.

    A yielded tensor is readable until the next one is requested (its file stays open till then).
    """
    report = report if report is not None else LoadReport()
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        st_files = [folder / name for name in files]
    else:
        st_files = sorted(folder.glob("*.safetensors"))
    if st_files:
        from safetensors import safe_open

        for file in st_files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    sliced = f.get_slice(name)
                    yield name, CheckpointTensor(name, tuple(sliced.get_shape()), sliced.__getitem__, report)
        return
    bin_files = sorted(folder.glob("pytorch_model*.bin"))
    if not bin_files:
        raise ModelNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {str(folder)!r}")
    for file in bin_files:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        for name, tensor in state.items():
            yield name, CheckpointTensor(name, tuple(tensor.shape), tensor.__getitem__, report)
