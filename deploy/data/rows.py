"""Rows in and out of a Ray Data batch: a batch (columns of numpy arrays) as plain
Python rows and back, and the error column Ray Data LLM marks failed rows with."""

from __future__ import annotations

from typing import Any

import numpy as np

#: Ray Data LLM's column for a row that failed alone (``should_continue_on_error``):
#: the error's message; "" on a row that succeeded
ERROR_COLUMN = "__inference_error__"


def to_python(value: Any) -> Any:
    """``value`` with numpy arrays and scalars (Ray Data's view of Arrow lists and
    numbers) turned into lists and Python numbers, through dicts and lists."""
    if isinstance(value, np.ndarray):
        return [to_python(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    return value


def batch_rows(batch: Any) -> list[dict[str, Any]]:
    """A batch (a pyarrow Table: the stages ask Ray Data for those, as Arrow keeps an
    int column with nulls ints where numpy would make it floats) as dicts of Python
    values (a column Arrow could not type travels pickled, numpy inside: converted)."""
    return [{k: to_python(v) for k, v in row.items()} for row in batch.to_pylist()]


def rows_batch(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Rows back into columns; a column some rows lack holds None there."""
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    return {name: [row.get(name) for row in rows] for name in names}


def failed(row: dict[str, Any]) -> bool:
    """Whether an earlier stage marked this row failed."""
    return bool(row.get(ERROR_COLUMN))


def drop_none(values: dict[str, Any]) -> dict[str, Any]:
    """A dict without its None entries: Arrow gives every row of a struct column every
    key the column's rows have, None where a row has none of its own."""
    return {k: v for k, v in values.items() if v is not None}
