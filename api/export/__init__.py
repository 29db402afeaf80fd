"""The run as a dataset: the ledger and the kept groups as Parquet (docs/ledger.md, "Export").

pyarrow is an optional extra (`pip install 'rollbuf[export]'`): nothing here is imported by the service at
import time. `api.export.table` converts (pure: records and ledger rows in, bounded Arrow record batches
out), `api.export.stream` pages through a store and writes Parquet as it goes, `api.export.cli` is
`rollbuf export`. `available()` says whether pyarrow can be imported, without importing it.
"""

from __future__ import annotations

from importlib.util import find_spec

PARQUET = "application/vnd.apache.parquet"
"""The media type of an exported table."""
MISSING = "the export needs pyarrow, an optional extra: pip install 'rollbuf[export]'"
"""What the endpoint (501) and the command (exit 2) say when pyarrow is not installed."""


def available() -> bool:
    """Whether pyarrow is installed (found, not imported: the service's import stays light)."""
    return find_spec("pyarrow") is not None
