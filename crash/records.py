"""What each client process writes down as it goes, so that the matrix counts from the clients' own records.

A producer's record is a JSON-lines file, one object a line, appended and flushed as each thing happens (a
kill -9 leaves at most its last line cut short, which `read` skips):

    {"t": 1712.5, "record": "producer", "side": "groups" | "tasks" | "rollouts", "pid": 123}   first line
    {"t": ..., "made": GROUP_ID}                 a whole group finished and is about to be sent
    {"t": ..., "ack": GROUP_ID}                  the server answered that it acknowledged that group
    {"t": ..., "done": SEED}                     a rollout finished (per-rollout groups: the seed names its slot)
    {"t": ..., "ack": [GROUP_ID, SLOT, DIGEST]}  the server acknowledged that rollout (DIGEST: of its tokens)

The episodes side (crash/episode_producer.py) writes, beside its rollouts' `ack` lines (DIGEST: of the whole
rollout, its turns' tokens included):

    {"t": ..., "open": [GROUP_ID, ENV, TASK_ID]}        about to ask the server to open that group
    {"t": ..., "turn": [GROUP_ID, SLOT, TURN, DIGEST]}  the server acknowledged that turn (DIGEST: of its tokens)
    {"t": ..., "gen": N}                                a completion of N tokens generated (not replayed)
    {"t": ..., "resumed": [GROUP_ID, SLOT, TOKENS]}     a slot continued from another producer's turns
    {"t": ..., "restarted": [GROUP_ID, SLOT]}           a slot with turns in, started again from the prompt

`t` is the wall clock (`time.time()`): the processes of a run share the machine's clock, so a fault's time and
the first acknowledgement after it compare. A task's group is acknowledged under its lease token as its group id
(`task:DATASET:EPOCH:INDEX:LEASE.NONCE`), so the tasks side writes the same lines as whole groups.

The trainer's record is its checkpoint (`tests/resuming_trainer.py`), which a real trainer has anyway and which
is what survives it: `trained` (per step, its group ids), `at` (per step, when it was trained) and `seqs` (per
step, each group's sequence digests, the per-rollout side's unit). What a killed trainer trained after its last
checkpoint is not in it: it is rolled back, as a real trainer's weights are, and trained again after the restart.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

SIDES = ("groups", "tasks", "rollouts", "episodes")
"""Whole groups, tasks leased from a dataset, per-rollout groups, multi-turn episodes posted turn by turn."""


def digest(tokens: Sequence[int]) -> str:
    """A rollout's identity as both ends see it: the producer hashes the tokens it posted, the trainer the tokens
    of each sequence it trained."""
    return hashlib.sha256(json.dumps([int(t) for t in tokens]).encode()).hexdigest()[:16]


class Writer:
    """Appends one line per event and flushes it, so that what the process was told survives its kill -9."""

    def __init__(self, path: Path, side: str, header: bool = True) -> None:
        """`header=False`: another process of the producer (a pool worker) appending to its record."""
        self._out: TextIO = path.open("a")
        if header:
            self.write(record="producer", side=side, pid=os.getpid())

    def write(self, **fields: Any) -> None:
        self._out.write(json.dumps({"t": time.time(), **fields}) + "\n")
        self._out.flush()

    def close(self) -> None:
        self._out.close()


def lines(path: Path) -> list[dict[str, Any]]:
    """The record's complete lines: a line cut short by a kill (no newline, or not JSON) is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().split("\n"):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


@dataclass
class Producer:
    """One producer process's record, read back."""

    side: str
    acks: list[tuple[float, Any]] = field(default_factory=list)
    """(time, group id) for groups and tasks; (time, (group id, slot, digest)) for rollouts."""
    made: list[tuple[float, Any]] = field(default_factory=list)
    """(time, group id) of whole groups finished; (time, seed) of rollouts finished."""
    opens: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Episodes: group id -> (env, task id), of each group it asked the server to open."""
    turns: list[tuple[float, tuple[str, int, int, str]]] = field(default_factory=list)
    """Episodes: (time, (group id, slot, turn, digest)) of each turn acknowledged."""
    generated: int = 0
    """Episodes: completions generated."""
    resumed: list[tuple[str, int, int]] = field(default_factory=list)
    """Episodes: (group id, slot, tokens taken from the prefix) of each slot continued from another's turns."""
    restarted: int = 0
    """Episodes: slots with turns in that it started again from the prompt."""


def read_producer(path: Path, side: str | None = None) -> Producer:
    """A producer's record; `side` for a record written without a header line (the per-rollout producer's)."""
    found = lines(path)
    for line in found:
        if line.get("record") == "producer":
            side = str(line["side"])
    if side is None:
        raise ValueError(f"{path}: no header line and no side given")
    out = Producer(side)
    for line in found:
        t = float(line.get("t", 0.0))
        if "ack" in line:
            ack = line["ack"]
            out.acks.append((t, tuple(ack) if isinstance(ack, list) else ack))
        if "made" in line:
            out.made.append((t, line["made"]))
        if "done" in line:
            out.made.append((t, line["done"]))
        if "open" in line:
            group_id, env, task_id = line["open"]
            out.opens[str(group_id)] = (str(env), str(task_id))
        if "turn" in line:
            group_id, slot, turn, turn_digest = line["turn"]
            out.turns.append((t, (str(group_id), int(slot), int(turn), str(turn_digest))))
        if "gen" in line:
            out.generated += 1
        if "resumed" in line:
            group_id, slot, tokens = line["resumed"]
            out.resumed.append((str(group_id), int(slot), int(tokens)))
        if "restarted" in line:
            out.restarted += 1
    return out


@dataclass
class Step:
    """One step of the trainer's checkpoint: when it was trained, its groups and their sequences' digests."""

    step: int
    at: float
    groups: list[str]
    seqs: dict[str, list[str]]


def read_trainer(path: Path) -> list[Step]:
    """The trained steps of a trainer's checkpoint (none if it never saved one)."""
    if not path.exists():
        return []
    saved = json.loads(path.read_text())
    at = saved.get("at", [])
    seqs = saved.get("seqs", [])
    out = []
    for k, (step, groups) in enumerate(saved["trained"]):
        out.append(
            Step(
                int(step),
                float(at[k]) if k < len(at) else 0.0,
                [str(g) for g in groups],
                dict(seqs[k]) if k < len(seqs) else {},
            )
        )
    return out
