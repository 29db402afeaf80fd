"""docs/crash-matrix.md, written from a matrix run's JSON (docs/crash-matrix.json), never by hand:

    python -m crash.page docs/crash-matrix.json docs/crash-matrix.md

`make crash-matrix` runs the matrix and then this."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from crash.count import failed as cell_failed
from crash.run import FAULTS

SIDE_TITLES = {
    "groups": "Whole groups",
    "tasks": "Tasks leased from a dataset (2 epochs)",
    "rollouts": "Per-rollout groups",
    "episodes": "Multi-turn episodes, posted turn by turn and resumed",
}
UNITS = {
    "groups": "groups",
    "tasks": "tasks (epoch, index)",
    "rollouts": "rollouts (group, slot)",
    "episodes": "rollouts (group, slot), and their turns (group, slot, turn)",
}
STORE_NAMES = {"sqlite": "SQLite", "postgresql": "PostgreSQL, 2 replicas"}

INTRO = """\
# The crash matrix: what each fault does to your data

<!-- Written by `python -m crash.page` from docs/crash-matrix.json (`make crash-matrix`): do not edit by hand. -->

For each fault, on each durable store and for each way of producing data, what happened to the data, counted
from the clients' own records: what each producer was told the server acknowledged (it writes a line after
each reply), and what the trainer trained (its checkpoint, which is what a trainer resumes from). Not from the
server's word about itself.

**Run it yourself**: `{command}` (as root for the full-disk row: it mounts a small tmpfs; PostgreSQL 15 on
127.0.0.1:5432 with trust auth, as `make test` uses, for the PostgreSQL rows). The code: `crash/` (`run.py`
one run, `count.py` the counter, `records.py` the record format, `page.py` this page).

| | |
|---|---|
| date | {date} |
| commit | `{commit}`{dirty} |
| machine | {machine} |
| command | `{command}` ({seconds:.0f} s of wall time) |
| scale | per run: {scale} |

Each run starts real processes, each its own process group: `rollbuf serve` (SQLite: one process; PostgreSQL:
two replicas of one database), the stand-in inference server (`demos/standin_inference.py`, {latency_ms:.0f} ms a
completion), a trainer through `trainer_client` (`tests/resuming_trainer.py`; **commit** mode: a loader reading 2
batches ahead, a checkpoint and a commit every 2 steps; **next** mode: Atropos's acknowledgement, a checkpoint
every step before asking for the next batch), and two producers through `rollout_client`'s `RolloutRunner` for
each side at once: whole groups of 2 (`crash/producer.py`, the example producer writing down what it was told),
tasks leased from a shuffled 2-epoch dataset, groups of 2 (`crash/producer.py --dataset`), per-rollout groups of
4, each rollout posted as it ends
(`tests/per_rollout_producer.py`), and multi-turn tool episodes in per-rollout groups of 4, each turn posted as
it ends (`crash/episode_producer.py`, below); for the pool worker's kill, each producer runs its rollouts in 2 worker
processes (`num_workers=2`). Task leases last {task_lease_s:g} s, a per-rollout holder's
{rollout_lease_s:g} s. Once a producer of each side has been told of an acknowledgement (episodes: of a turn;
for the trainer's kill: and the trainer has checkpointed), the fault comes; the run goes on until every side has
done its work, the last batch is completed with filler groups, and the trainer has trained it.

The columns:

- **acknowledged**: distinct units some producer was told the server acknowledged.
- **lost**: acknowledged, never trained. **Must be 0.**
- **trained twice**: trained in more than one step (a task under any of its leases). **Must be 0.**
- **at-least-once**: trained twice under a documented at-least-once edge kept on purpose, with the reason;
  counted here, never hidden in a 0. None is kept today: the runner always sends group ids (so the
  PostgreSQL edge "a submission without either can be stored twice", docs/stores.md, cannot occur), a task's
  group is acknowledged only as its lease's submission (docs/tasks.md), and a slot's second rollout is
  `redone`, not stored (docs/rollouts.md).
- **redone**: work the fault made the producers do again: whole groups finished and never acknowledged (a
  new group takes the place of each), tasks acknowledged under a lease other than their first (their first
  lease lapsed or was handed back: its rollouts thrown away, whole or in part), rollouts finished more than
  once (a sibling redid a slot whose rollout had finished but whose acknowledgement never came).
- **recover**: seconds from the fault until that side had both a group acknowledged and a group trained after
  it (it includes starting a killed process again; a side the fault did not stop recovers at once).
- **unclaimed**: trained units no producer's record claims: the server acknowledged them, but the reply never
  reached a producer that lived to write it down (killed between the server's commit and its own line). Not
  lost, not twice.

`make test` runs every row at a smaller scale (`tests/integration/test_crash_matrix.py`) and fails if any
lost or trained-twice count is not 0, an acknowledged turn is lost, or a trained episode is not
token-exact.
"""

MEMORY = """\
## The memory store (`memory://`)

Not in the matrix, and not tested across restarts: it keeps everything in the server's process, so a kill -9
(or any stop) of the server loses everything queued, every kept batch, the step, the task cursor and every open
per-rollout group. Faults of the other processes (a producer, a pool worker, the trainer, a paused producer)
do not touch the store, and the memory store answers them as SQLite does: it is the reference twin of the
others under the same contract (`tests/store/test_contract.py`), only not durable. A full disk and a cut
database connection do not apply to it.
"""


def cell_text(side: str, cell: dict[str, Any]) -> list[str]:
    edge = str(cell["at_least_once"])
    if cell.get("at_least_once_reason"):
        edge += f" ({cell['at_least_once_reason']})"
    lost = f"**{cell['lost']}**" if cell["lost"] else "0"
    twice = f"**{cell['trained_twice']}**" if cell["trained_twice"] else "0"
    recover = "—" if cell["recover_s"] is None else f"{cell['recover_s']:.1f} s"
    return [str(cell["acknowledged"]), lost, twice, edge, str(cell["redone"]), recover, str(cell["unclaimed"])]


def row_name(run: dict[str, Any]) -> str:
    return f"{run['fault']}" + (f" ({run['mode']} mode)" if run["fault"] == "trainer" else "")


def table(side: str, runs: list[dict[str, Any]]) -> list[str]:
    out = [f"## {SIDE_TITLES[side]}", "", f"Units: {UNITS[side]}.", ""]
    out += [
        "| fault | store | acknowledged | lost | trained twice | at-least-once | redone | recover | unclaimed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        head = [
            FAULTS[run["fault"]] + (f" — trainer in {run['mode']} mode" if run["fault"] == "trainer" else ""),
            STORE_NAMES[run["store"]],
        ]
        if "not_run" in run:
            out.append("| " + " | ".join(head + [f"does not apply: {run['not_run']}"] + [""] * 6) + " |")
        elif "error" in run:
            cells = cell_text(side, run["cells"][side]) if "cells" in run else [""] * 7
            out.append("| " + " | ".join(head + cells) + " |")
            out.append("| " + " | ".join(["", "", f"**did not finish**: {run['error'][:300]}"] + [""] * 6) + " |")
        else:
            out.append("| " + " | ".join(head + cell_text(side, run["cells"][side])) + " |")
    return out + [""]


EPISODES = """\
## Multi-turn episodes, posted turn by turn and resumed

Two producers (`crash/episode_producer.py`, `RolloutRunner`) each open {groups} group(s) of 4, of two envs in turn
(the first producer starting with one, the second with the other), of a multi-turn tool episode
(`crash/episodes.py`: each generation names a move, a deterministic tool answers the new position; 6 to 10 turns
an episode, {gen_ms:.0f} ms a generation): `trek` resumes a slot by replaying its recorded completions against the
tool (`resumes = "replay"`), `trek_snapshot` by restoring the episode from the last turn's snapshot
(`"snapshot"`). Each turn is posted as it ends; a producer that takes the slot of one that stopped continues it
from its acknowledged turns (docs/episodes.md). The policy is a deterministic stand-in (`ScriptedPolicy`: its
completions depend only on the prompt and the rollout's seed, the seed only on the group id and slot), so the
counter runs each group's env and policy again in its own process, with no server and no fault,
and holds every trained rollout to it.

Units: {units}. The columns, beside those above (for rollouts):

- **turns acknowledged**: distinct turns some producer was told the server acknowledged.
- **turns lost**: acknowledged turns that are not part of their slot's trained rollout (that rollout is not the
  uninterrupted run's, or the turn's tokens are not its turn). **Must be 0.**
- **not token-exact**: trained rollouts whose tokens are not those the uninterrupted run makes for a slot of
  their group. **Must be 0.**
- **redone**: completions generated beyond those the trained rollouts hold: turns generated twice (a slot
  started again from the prompt, or turns generated but not acknowledged before the fault).
- **resumed**: slots continued from another producer's acknowledged turns; **restarted**: slots with turns in
  that started again from the prompt (a pool worker's turns are posted by its runner: a killed worker's slots
  continue from them on a new worker).
- **tokens resumed**: tokens the resumed slots took from their turns instead of generating them again.
"""
EPISODE_COLUMNS = (
    "| fault | store | acknowledged | lost | trained twice | turns acknowledged | turns lost | not token-exact "
    "| redone | resumed | restarted | tokens resumed | recover |"
)


def episodes_table(runs: list[dict[str, Any]], groups: int = 0, gen_s: float = 0.0) -> list[str]:
    """The episodes side's table; a run measured before the side existed says so in its row."""
    out = [EPISODES.format(groups=groups or "some", gen_ms=1000 * gen_s, units=UNITS["episodes"]), EPISODE_COLUMNS]
    out.append("|" + "---|" * 13)
    for run in runs:
        head = [
            FAULTS[run["fault"]] + (f" — trainer in {run['mode']} mode" if run["fault"] == "trainer" else ""),
            STORE_NAMES[run["store"]],
        ]
        cell = run.get("cells", {}).get("episodes")
        if "not_run" in run:
            out.append("| " + " | ".join(head + [f"does not apply: {run['not_run']}"] + [""] * 10) + " |")
            continue
        if cell is None:
            out.append("| " + " | ".join(head + ["not measured in this run"] + [""] * 10) + " |")
            continue
        bold = [f"**{cell[k]}**" if cell[k] else "0" for k in ("lost", "trained_twice")]
        exact = [f"**{cell[k]}**" if cell[k] else "0" for k in ("turns_lost", "not_token_exact")]
        recover = "—" if cell["recover_s"] is None else f"{cell['recover_s']:.1f} s"
        counts = [str(cell["acknowledged"]), *bold, str(cell["turns_acknowledged"]), *exact, str(cell["redone"])]
        counts += [str(cell["slots_resumed"]), str(cell["slots_restarted"]), f"{cell['tokens_resumed']:,}", recover]
        out.append("| " + " | ".join(head + counts) + " |")
        if "error" in run:
            out.append("| " + " | ".join(["", "", f"**did not finish**: {run['error'][:300]}"] + [""] * 10) + " |")
    return out + [""]


def render(matrix: dict[str, Any]) -> str:
    scale = matrix["scale"]
    text = INTRO.format(
        command=matrix["command"],
        date=matrix["date"],
        commit=matrix["commit"],
        dirty=" (with uncommitted changes in the tree)" if matrix.get("dirty") else "",
        machine=matrix["machine"],
        seconds=matrix["seconds"],
        scale=(
            f"{scale['tasks']} tasks x {scale['epochs']} epochs; {scale['groups']} whole groups per producer; "
            f"{scale['rollout_groups']} per-rollout groups per producer; "
            + (
                f"{scale['episode_groups']} episodes groups per producer (of its two envs in turn); "
                if "episode_groups" in scale
                else ""
            )
            + f"batches of {matrix['batch']} sequences"
        ),
        task_lease_s=matrix["task_lease_s"],
        rollout_lease_s=matrix["rollout_lease_s"],
        latency_ms=1000 * matrix["latency_s"],
    )
    lines = [text]
    failed = [r for r in matrix["runs"] if r.get("error") or any(map(cell_failed, r.get("cells", {}).values()))]
    if failed:
        lines.append(
            "**Runs that lost data, trained it twice, or did not finish**: "
            + "; ".join(f"{row_name(r)} on {STORE_NAMES[r['store']]}" for r in failed)
            + ". Their rows say what.\n"
        )
    else:
        lines.append(
            "**In this run nothing acknowledged was lost and nothing was trained twice, in any cell; every trained "
            "episode was token-exact.**\n"
        )
    for side in ("groups", "tasks", "rollouts"):
        lines += table(side, matrix["runs"])
    lines += episodes_table(matrix["runs"], scale.get("episode_groups", 0), matrix.get("episode_gen_s", 0.0))
    lines.append(MEMORY)
    return "\n".join(lines)


def main() -> None:
    source, target = Path(sys.argv[1]), Path(sys.argv[2])
    target.write_text(render(json.loads(source.read_text())))


if __name__ == "__main__":
    main()
