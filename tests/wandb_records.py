"""Read an offline W&B run back with W&B's own record schema (``wandb.proto.wandb_internal_pb2``).

wandb >= 0.2x writes ``run-<id>.wandb``: a LevelDB-style log (32 KiB blocks of records, each with
a 7-byte header: CRC32, length, type FULL/FIRST/MIDDLE/LAST) after a 7-byte file header
(``:W&B``, magic, version); every record is a serialized ``Record`` protobuf. The Python reader that
used to ship with wandb is gone, so this is the ~30 lines it took.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

_FILE_HEADER = struct.Struct("<4sHB")
_RECORD_HEADER = struct.Struct("<IHB")
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    data = Path(path).read_bytes()
    ident, _magic, _version = _FILE_HEADER.unpack_from(data, 0)
    assert ident == b":W&B", f"{path} is not a W&B record log"
    pos, buf, out = _FILE_HEADER.size, b"", []
    while pos + _RECORD_HEADER.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _RECORD_HEADER.size:  # block trailer padding
            pos += left
            continue
        crc, length, kind = _RECORD_HEADER.unpack_from(data, pos)
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        payload = data[pos + _RECORD_HEADER.size: pos + _RECORD_HEADER.size + length]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"bad CRC at byte {pos}"
        pos += _RECORD_HEADER.size + length
        if kind == _FULL:
            buf = payload
        elif kind == _FIRST:
            buf = payload
            continue
        elif kind == _MIDDLE:
            buf += payload
            continue
        else:
            buf += payload
        record = pb.Record()
        record.ParseFromString(buf)
        out.append(record)
        buf = b""
    return out


def _items(items) -> dict:
    out: dict = {}
    for it in items:
        key = "/".join(it.nested_key) if it.nested_key else it.key
        out[key] = json.loads(it.value_json)
    return out


class OfflineRun:
    """The run id, config, history rows and final summary of one offline run directory."""

    def __init__(self, run_dir: Path) -> None:
        files = list(Path(run_dir).glob("run-*.wandb"))
        assert len(files) == 1, f"expected one run-*.wandb in {run_dir}, found {files}"
        self.records = read_records(files[0])
        runs = [r.run for r in self.records if r.WhichOneof("record_type") == "run"]
        self.run_id = runs[0].run_id
        self.project = runs[0].project
        self.tags = list(runs[0].tags)
        self.config: dict = {}
        self.history: list[dict] = []
        self.summary: dict = {}
        for r in self.records:
            kind = r.WhichOneof("record_type")
            if kind == "config":
                self.config.update({u.key: json.loads(u.value_json) for u in r.config.update})
            elif kind == "history":
                self.history.append(_items(r.history.item))
            elif kind == "summary":
                self.summary.update(_items(r.summary.update))
