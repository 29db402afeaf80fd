"""Reads the records of a W&B run file (`run-<id>.wandb`, written in offline mode): wandb 0.31 ships no
Python reader, so this follows its on-disk format (LevelDB's log format: 32 KiB blocks of checksummed,
possibly fragmented records after a 7-byte `:W&B` header) and decodes each record with wandb's own protobuf
schema."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a record header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if kind == 0:
            break
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        else:
            out.append(pending + chunk)
    parsed = []
    for raw in out:
        rec = pb.Record()
        rec.ParseFromString(raw)
        parsed.append(rec)
    return parsed


def history(recs: list[Any]) -> list[dict[str, Any]]:
    """Each logged step as a dict (keys joined with "/", values decoded from JSON)."""
    rows = []
    for rec in recs:
        if rec.WhichOneof("record_type") == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


def run_info(recs: list[Any]) -> Any:
    return next(rec.run for rec in recs if rec.WhichOneof("record_type") == "run")
