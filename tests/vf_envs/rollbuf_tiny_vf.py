"""The tiny verifiers taskset of rollbuf's producer tests (`tests/verifiers_tiny.py`): say a word back; the
reward is 1.0 when the reply holds it. A top-level module because verifiers imports a taskset by its id."""

import verifiers.v1 as vf

WORDS = ["apple", "river", "stone", "cloud", "amber", "maple", "delta", "ember"]


class TinyTaskData(vf.TaskData):
    answer: str = ""


class TinyTask(vf.Task[TinyTaskData]):
    @vf.stop
    async def one_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def said_it(self, task: TinyTaskData, trace: vf.Trace) -> float:
        reply = trace.assistant_messages[-1].content if trace.assistant_messages else ""
        return float(task.answer in (reply or ""))


class TinyTaskset(vf.Taskset[TinyTask]):
    def load(self) -> list[TinyTask]:
        return [TinyTask(TinyTaskData(prompt=f"Say {w}.", answer=w), self.config.task) for w in WORDS]


__all__ = ["TinyTaskset"]
