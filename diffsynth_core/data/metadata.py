"""Metadata files: CSV, JSON (a list of objects) or JSONL (one object per line) → list of dicts.

The three formats give the same records for the same rows: CSV cells are read as strings
(never as numbers or NaN, so a prompt like "NA" or "1984" survives) and an empty CSV cell
becomes None, like a JSON null; so does a cell of whitespace alone (a prompt of spaces is no
prompt).  A key given twice in one JSON object is an error, never the last value silently.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from .errors import DatasetError
from .media import MEDIA_EXTENSIONS

METADATA_FORMATS = (".csv", ".json", ".jsonl")
# The prompt column: `prompt` is the name DiffSynth-Studio uses; `caption` and `text`
# are what most captioning tools write. The first one present wins.
PROMPT_COLUMNS = ("prompt", "caption", "text")


def load_metadata(path: str | Path) -> list[dict[str, Any]]:
    """Read a metadata file into one dict per row; raises DatasetError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError("metadata file not found", metadata=path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        records = _read_csv(path)
    elif suffix == ".json":
        records = _read_json(path)
    elif suffix == ".jsonl":
        records = _read_jsonl(path)
    else:
        raise DatasetError(f"unsupported metadata format {suffix!r}; use one of "
                           f"{', '.join(METADATA_FORMATS)}", metadata=path)
    if not records:
        raise DatasetError("metadata has no rows", metadata=path)
    return [{k: _none_if_blank(v) for k, v in r.items()} for r in records]


def _read_csv(path: Path) -> list[dict[str, Any]]:
    """RFC 4180 CSV (Python's csv module, strict): a row with more cells than the header is an error.

    An unquoted comma in a prompt splits it into two cells; pandas then silently shifts the
    row (or, when every row has one extra cell, takes the first column as the index and cuts
    the prompt), so the row is named instead.  A quote left open would swallow the rows after it
    into one cell: strict parsing refuses it, and so is a quoted cell that spans lines which read
    like rows of their own.  Empty trailing cells (spreadsheets add them) and missing trailing
    cells (optional columns) are fine.
    """
    line = 1
    try:
        # utf-8-sig: spreadsheets often write a byte-order mark before the header.
        with path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.reader(handle, strict=True)
            header = _csv_header(next(reader, []), path)
            records: list[dict[str, Any]] = []
            line = reader.line_num + 1
            for cells in reader:
                row_line, line = line, reader.line_num + 1
                if not any(cell.strip() for cell in cells):
                    continue  # a blank line is not a row
                if any(cell.strip() for cell in cells[len(header):]):
                    raise DatasetError(
                        f"line {reader.line_num} has {len(cells)} cells but the header has {len(header)} "
                        f"columns ({', '.join(header)}): a cell holds an unquoted comma; put such cells in "
                        f'double quotes, e.g. "a cat, sitting on a mat"', metadata=path, row=len(records))
                _refuse_swallowed_rows(cells, row_line, path, len(records))
                cells = cells[:len(header)] + [""] * (len(header) - len(cells))
                records.append({k: (None if v == "" else v) for k, v in zip(header, cells)})
    except csv.Error as e:
        raise DatasetError(f"cannot parse CSV: a quote opened on line {line} is not closed where the cell ends "
                           f"({e}); the rows after it would be read into that cell: close the quote, and write a "
                           'quote inside a quoted cell as two ("")', metadata=path) from e
    except UnicodeDecodeError as e:
        raise DatasetError(f"cannot parse CSV: {e}: save it as UTF-8", metadata=path) from e
    return records


def _refuse_swallowed_rows(cells: list[str], line: int, path: Path, row: int) -> None:
    """A quoted cell over several lines, one of which starts like a row naming a media file
    (``b.png,...``): a quote that was meant to close on its own line."""
    for cell in cells:
        for continued in cell.splitlines()[1:]:
            first = continued.split(",", 1)[0].strip()
            if "," in continued and Path(first).suffix.lower() in MEDIA_EXTENSIONS:
                raise DatasetError(f"a quoted cell opened on line {line} runs over the next lines, taking "
                                   f"{continued[:60]!r} into it as text: close the quote on its own line",
                                   metadata=path, row=row)


def _csv_header(cells: list[str], path: Path) -> list[str]:
    header = [cell.strip() for cell in cells]
    while header and not header[-1]:
        header.pop()  # trailing separators after the last column name
    if not header:
        raise DatasetError("metadata has no header row (e.g. image,prompt)", metadata=path)
    repeated = sorted({name for name in header if header.count(name) > 1})
    if repeated or "" in header:
        what = f"column(s) {repeated} appear twice" if repeated else "a column has no name"
        raise DatasetError(f"CSV header {','.join(header)}: {what}; give every column one unique name",
                           metadata=path)
    return header


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"), object_pairs_hook=unique_keys)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise DatasetError(f"cannot parse JSON: {e}", metadata=path) from e
    if not isinstance(data, list):
        raise DatasetError(f"JSON metadata must be a list of objects, got {type(data).__name__}",
                           metadata=path)
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise DatasetError(f"row is a {type(row).__name__}, expected an object",
                               metadata=path, row=i)
    return data


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"line {line_no}: byte 0x{raw[e.start]:02x} is not UTF-8 (a Latin-1 file?): "
                                   "save it as UTF-8", metadata=path) from None
            if not line.strip():
                continue  # blank lines (a trailing newline, say) are not rows
            try:
                row = json.loads(line, object_pairs_hook=unique_keys)
            except ValueError as e:
                raise DatasetError(f"line {line_no} is not valid JSON: {e}", metadata=path) from e
            if not isinstance(row, dict):
                raise DatasetError(f"line {line_no} is a {type(row).__name__}, expected an object",
                                   metadata=path)
            records.append(row)
    return records


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads(..., object_pairs_hook=unique_keys)``: a key given twice is an error, not the last value."""
    result = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"key {key!r} appears twice in one object (which value is meant?)")
        result[key] = value
    return result


def _none_if_blank(value: Any) -> Any:
    # JSON may carry NaN (Python's json accepts it); treat it as a missing value, like null, and
    # so a string of whitespace alone (no prompt, no file).
    if isinstance(value, float) and math.isnan(value):
        return None
    return None if isinstance(value, str) and not value.strip() else value


def find_columns(records: list[dict[str, Any]], data_file_keys: tuple[str, ...],
                 metadata: str | Path) -> tuple[str, tuple[str, ...]]:
    """Return (prompt column, media columns present); raise if either is missing."""
    columns = {k for r in records for k in r}
    prompt = next((c for c in PROMPT_COLUMNS if c in columns), None)
    media = tuple(k for k in data_file_keys if k in columns)
    problems = []
    if prompt is None:
        problems.append(f"no prompt column (expected one of {', '.join(PROMPT_COLUMNS)})")
    if not media:
        problems.append(f"none of the data_file_keys columns ({', '.join(data_file_keys)})")
    if problems:
        raise DatasetError(f"metadata has {' and '.join(problems)}; its columns are "
                           f"{sorted(columns)}", metadata=metadata)
    return prompt, media
