"""A prepared split read back with pyarrow alone: the Arrow files of a `datasets` `save_to_disk` directory,
memory-mapped, as rows of Python values.

The launching process writes each split with `datasets` (arrow_split.py, preference_prepare.py); every rank and the
launching process then only read it. Opening a split with `datasets.load_from_disk` costs 0.74-0.79 CPU seconds per
process on the 2-core test machine (pandas, fsspec, its config and its `Dataset` machinery; torch and transformers
already imported), with pyarrow alone 0.40-0.53, before a rank's first step. `ArrowRows` offers what dsrecipes reads
from a split: its length, a row (a dict of Python values), several rows at once (`__getitems__`, as DataLoader
fetches a batch), a column, the first rows (`select`) and iteration in order, the same values `datasets.Dataset`
gives (a test compares them).
"""

from __future__ import annotations

import array
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Union

import pyarrow as pa

from dsrecipes.core.errors import DataError
from dsrecipes.core.fileio import read_json_file

STATE_FILE = "state.json"  # datasets' save_to_disk: which Arrow files hold the rows, in order


class ArrowRows:
    """Rows of one prepared split (a pyarrow Table, memory-mapped from the cache; never copied into memory)."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.cache_files: List[Dict[str, str]] = []  # the memory-mapped files (strategies/map.py checks them)

    @classmethod
    def open(cls, path: Union[str, Path]) -> "ArrowRows":
        """The split `datasets.Dataset.save_to_disk(path)` wrote: its Arrow stream files, in order, memory-mapped."""
        path = Path(path)
        try:
            state = read_json_file(path / STATE_FILE, "JSON nested too deeply")  # bounded, as any cache file
            files = [path / entry["filename"] for entry in state["_data_files"]]
            if state.get("_indices_data_files"):  # never written by dsrecipes (it saves whole tables)
                raise DataError(f"{path}: an indices mapping this reader does not follow; prepare the data again")
            tables = [pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files]
        except (OSError, KeyError, TypeError, ValueError, pa.ArrowInvalid) as exc:
            raise DataError(f"{path}: not a readable prepared split ({exc}); prepare the data again") from exc
        if not tables:
            raise DataError(f"{path}: {STATE_FILE} lists no Arrow file; prepare the data again")
        rows = cls(tables[0] if len(tables) == 1 else pa.concat_tables(tables))
        rows.cache_files = [{"filename": str(f)} for f in files]  # as datasets names them: watched while mapped
        return rows

    @property
    def column_names(self) -> List[str]:
        return list(self.table.column_names)

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, key: Union[int, str]) -> Any:
        if isinstance(key, str):
            return self.table.column(key).to_pylist()
        n = len(self)
        index = key + n if key < 0 else key
        if not 0 <= index < n:
            raise IndexError(f"row {key} of {n}")
        return self.table.slice(index, 1).to_pylist()[0]

    def __getitems__(self, keys: List[int]) -> List[Dict[str, Any]]:
        """Several rows in one pass (DataLoader's batched fetch), in the order asked."""
        return self.select(keys).table.to_pylist()

    def select(self, indices: Iterable[int]) -> "ArrowRows":
        return ArrowRows(self.table.take(_int64_array(indices)))

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        for batch in self.table.to_batches(max_chunksize=256):
            yield from batch.to_pylist()


def _int64_array(values: Iterable[int]) -> pa.Array:
    """`values` as an Arrow int64 array, built from a buffer: `pa.array(...)` checks whether its input is a pandas
    object and so imports pandas, 0.36-0.45 CPU s in every rank that reads a split (its first batch)."""
    data = array.array("q", values)
    return pa.Array.from_buffers(pa.int64(), len(data), [None, pa.py_buffer(data)])
