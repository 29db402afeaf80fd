"""The crash matrix's whole-group and leased-task producer: rollbuf's example producer (`demos/example_producer.py`)
with `--record PATH`, where it writes each group it sends and each acknowledgement it is told of, as
`crash/records.py` reads them. The recording wraps the runner's submit: instrumentation for counting what was
lost or trained twice, not something a producer needs.

    python -m crash.producer --server URL --inference URL --record PATH [the example producer's flags]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from api.wire.schema import ScoredData, ScoredReply
from crash.records import Writer
from demos import example_producer
from rollout_client import RolloutRunner


def record(runner: RolloutRunner, writer: Writer) -> None:
    """Write each group as it is sent (`made`) and once the server acknowledged it (`ack`; a duplicate too: the
    server says it holds it), after its reply: a kill in between writes nothing."""
    submit = runner._submits.submit

    async def submitted(i: int, group: ScoredData) -> ScoredReply:
        writer.write(made=group.group_id)
        reply = await submit(i, group)
        writer.write(ack=group.group_id)
        return reply

    runner._submits.submit = submitted  # type: ignore[method-assign,assignment]


def instrument(runner: RolloutRunner, args: argparse.Namespace) -> None:
    record(runner, Writer(args.record, "tasks" if args.dataset else "groups"))


def main() -> None:
    ap = example_producer.parser()
    ap.prog = "python -m crash.producer"
    ap.add_argument("--record", type=Path, required=True, help="write what it was told here (crash/records.py)")
    example_producer.main(ap=ap, instrument=instrument)


if __name__ == "__main__":
    main()
