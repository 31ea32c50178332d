"""The one error type of the dataset, and how it names where the problem is."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError


class DatasetError(InputError):
    """Bad metadata or a bad media file.

    The message names the metadata file, the row (both the 1-based data row, header not
    counted, and the 0-based index that `SampleDataset.load` takes) and the media file, so
    a user can find the line to fix. The parts stay available as attributes so
    `skip_bad_samples` can report them without parsing the message.
    """

    def __init__(self, reason: str, *, metadata: str | Path | None = None,
                 row: int | None = None, file: str | Path | None = None):
        self.reason = reason
        self.metadata = None if metadata is None else str(metadata)
        self.row = row
        self.file = None if file is None else str(file)
        super().__init__(self._format())  # InputError: exit code 2, never retried

    def __reduce__(self):
        # Keep the parts across pickling (DataLoader workers, multiprocessing pools).
        return _rebuild, (self.reason, self.metadata, self.row, self.file)

    def _format(self) -> str:
        where = []
        if self.metadata is not None:
            where.append(self.metadata)
        if self.row is not None:
            where.append(f"data row {self.row + 1} (index {self.row})")
        if self.file is not None:
            where.append(f"file {self.file}")
        return f"{', '.join(where)}: {self.reason}" if where else self.reason


def _rebuild(reason: str, metadata: str | None, row: int | None, file: str | None) -> DatasetError:
    return DatasetError(reason, metadata=metadata, row=row, file=file)
