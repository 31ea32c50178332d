"""Several datasets trained as one: rows of each, in order, each repeated its own number of times.

``ConcatSamples`` offers the row-level verbs preprocessing uses on a ``SampleDataset``
(``records``, ``source_files``, ``key_settings``, ``target_fields``, ``reference_settings``,
``load``, ``skipped``), so one training run can
mix datasets with different folders, sizes, frame counts and repeats.  A repeated row is the
same row again: it gets the same cache key, is encoded once and is trained on as many times.
"""

from __future__ import annotations

from typing import Any, Sequence

from .dataset import Sample, SampleDataset


class ConcatSamples:
    def __init__(self, parts: Sequence[tuple[SampleDataset, int]]):
        """``parts``: (dataset, repeat) pairs, in training order."""
        self.parts = [dataset for dataset, _ in parts]
        self._rows: list[tuple[int, int]] = []  # global row -> (part, row in that part)
        self._first: list[int] = []  # global row -> global row of its first repetition
        for part, (dataset, repeat) in enumerate(parts):
            start = len(self._rows)
            for _ in range(repeat):
                self._first += [start + row for row in range(len(dataset.records))]
                self._rows += [(part, row) for row in range(len(dataset.records))]
        self.records: list[dict[str, Any]] = [self.parts[p].records[r] for p, r in self._rows]

    @property
    def metadata_path(self) -> str:
        """What error messages name as the data: the sources' own files are named row by row."""
        return "dataset.sources"

    def __len__(self) -> int:
        return len(self._rows)

    def first_row(self, index: int) -> int:
        """The row that ``index`` repeats (itself for a first occurrence): preprocessing parts
        split rows by it, so one part encodes a row and all its repeats."""
        return self._first[index]

    def source_files(self, index: int):
        part, row = self._rows[index]
        return self.parts[part].source_files(row)

    def key_settings(self, index: int) -> dict[str, Any]:
        part, row = self._rows[index]
        return self.parts[part].key_settings(row)

    def target_fields(self, index: int) -> dict[str, Any]:
        part, row = self._rows[index]
        return self.parts[part].target_fields(row)

    def reference_settings(self, index: int) -> dict[str, Any]:
        part, row = self._rows[index]
        return self.parts[part].reference_settings(row)

    def prompt_column_of(self, index: int) -> str:
        part, row = self._rows[index]
        return self.parts[part].prompt_column_of(row)

    def load(self, index: int) -> Sample | None:
        part, row = self._rows[index]
        return self.parts[part].load(row)

    @property
    def skipped(self) -> list[tuple[int, str, str]]:
        """(global row, file, reason) of every row whose source row was skipped."""
        bad = [{row: (file, reason) for row, file, reason in dataset.skipped} for dataset in self.parts]
        return [(index, *bad[part][row]) for index, (part, row) in enumerate(self._rows) if row in bad[part]]
