"""The run as a dataset: the ledger and the kept groups as Parquet (docs/ledger.md, "Export").

pyarrow is an optional extra (`pip install 'rollbuf[export]'`): nothing here is imported by the service at
import time. `api.export.table` converts (pure: records and ledger rows in, bounded Arrow record batches
out), `api.export.stream` pages through a store and writes Parquet as it goes, `api.export.cli` is
`rollbuf export`. `available()` says whether pyarrow can be imported.
"""

from __future__ import annotations

PARQUET = "application/vnd.apache.parquet"
"""The media type of an exported table."""
MISSING = "the export needs pyarrow, an optional extra: pip install 'rollbuf[export]'"
"""What the endpoint (501) and the command (exit 2) say when pyarrow is not installed."""


def available() -> bool:
    """Whether pyarrow can be imported: asked when an export starts, never when the service starts."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True
