"""An endless verifiers taskset (`Taskset.INFINITE`, generated on demand) for `verifiers_tasks`' tests: the
tiny task, one new word per index."""

from collections.abc import Iterator

import verifiers.v1 as vf
from rollbuf_tiny_vf import TinyTask, TinyTaskData


class EndlessTaskset(vf.Taskset[TinyTask]):
    INFINITE = True

    def load(self) -> Iterator[TinyTask]:
        i = 0
        while True:
            yield TinyTask(TinyTaskData(prompt=f"Say w{i}.", answer=f"w{i}"), self.config.task)
            i += 1


__all__ = ["EndlessTaskset"]
