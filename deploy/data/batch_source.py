"""A batch file's runnable lines as a Ray Data datasource: one read task streams the
file (through pyarrow's filesystems) and hands Ray Data blocks of the lines the driver
marked to run (a bitmap of line numbers), parsed: ``line``, ``custom_id``, ``key``,
``call``, ``body`` (JSON text)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
from ray.data import Datasource
from ray.data.block import BlockMetadata
from ray.data.datasource import ReadTask

from deploy.batch_file import parse_line

#: Rows per block the read task hands Ray Data
BLOCK_ROWS = 256


class BatchLines(Datasource):
    def __init__(self, uri: str, run: bytes, count: int, lines: Callable[[str], Iterator[tuple[int, str]]]) -> None:
        super().__init__()
        self.uri, self.run, self.count, self.lines = uri, run, count, lines

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        uri, run, lines = self.uri, self.run, self.lines

        def read() -> Iterator[pa.Table]:
            rows: list[dict[str, Any]] = []
            for n, text in lines(uri):
                if n >> 3 >= len(run) or not run[n >> 3] & (1 << (n & 7)):
                    continue
                request, key, _ = parse_line(text, n)
                if request is None:  # the file changed since the driver read it
                    continue
                rows.append({"line": n, "custom_id": request.custom_id, "key": key, "call": request.call,
                             "body": request.body})
                if len(rows) == BLOCK_ROWS:
                    yield pa.Table.from_pylist(rows)
                    rows = []
            if rows:
                yield pa.Table.from_pylist(rows)

        meta = BlockMetadata(num_rows=self.count, size_bytes=None, input_files=None, exec_stats=None)
        return [ReadTask(read, meta)]
