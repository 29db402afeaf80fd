"""The crash matrix's counter (crash/count.py) and record reader (crash/records.py): each count from records
whose answer is known (for episodes, with a reference given by hand), so that a 0 in the matrix means nothing
was lost, not that the counter looked away."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from crash.count import EpisodesCell, count, failed, parse_token
from crash.episodes import Expected
from crash.records import Producer, Step, Writer, read_producer, read_trainer


def step(n: int, at: float, *groups: str, seqs: dict[str, list[str]] | None = None) -> Step:
    return Step(n, at, list(groups), seqs or {})


def test_whole_groups_acknowledged_trained_lost_twice_and_redone() -> None:
    p = Producer("groups", acks=[(1.0, "a"), (2.0, "b"), (3.0, "c")], made=[(0.5, g) for g in "abcd"])
    steps = [step(0, 1.5, "a", "filler-1"), step(1, 4.0, "b", "a")]
    cell = count([p], steps, fault_at=2.5)["groups"]
    assert (cell.acknowledged, cell.lost, cell.trained_twice, cell.redone) == (3, 1, 1, 1)
    assert cell.examples == {"lost": ["c"], "trained_twice": ["a"]}
    assert cell.recover_s == 1.5  # the first ack after the fault (3.0) and the first step after it (4.0)
    assert cell.failed()


def test_a_task_is_one_unit_under_all_its_lease_tokens() -> None:
    t1, t2, t3 = "task:d:0:5:1.ab", "task:d:0:5:2.cd", "task:d:1:5:1.ef"
    p = Producer("tasks", acks=[(1.0, t1), (2.0, t3)], made=[(0.5, t1), (1.5, t3), (1.6, "task:d:0:7:1.00")])
    q = Producer("tasks", acks=[(3.0, t2)], made=[(2.5, t2)])
    cell = count([p, q], [step(0, 2.0, t1), step(1, 4.0, t2, t3)])["tasks"]
    # (0, 5) acknowledged under two leases and trained under both: once too many; (1, 5) is another epoch's
    assert (cell.acknowledged, cell.lost, cell.trained_twice, cell.redone) == (2, 0, 1, 1)
    assert cell.recover_s is None  # no fault


def test_rollouts_counted_by_slot_and_tokens() -> None:
    p = Producer(
        "rollouts",
        acks=[(1.0, ("g", 0, "x")), (1.1, ("g", 1, "x")), (1.2, ("h", 0, "y"))],
        made=[(0.9, 11), (1.0, 12), (1.1, 13), (5.0, 13)],
    )
    fine = [step(0, 2.0, "g", "h", seqs={"g": ["x", "x"], "h": ["y"]})]
    cell = count([p], fine)["rollouts"]
    assert (cell.acknowledged, cell.lost, cell.trained_twice, cell.redone) == (3, 0, 0, 1)
    lost_one = [step(0, 2.0, "g", seqs={"g": ["x"]}), step(1, 3.0, "g", seqs={"g": ["x"]})]
    cell = count([p], lost_one)["rollouts"]
    assert (cell.lost, cell.trained_twice) == (2, 1)  # h never trained, g's second slot neither; g trained again


def test_trained_without_a_producer_s_record_is_unclaimed_not_lost() -> None:
    p = Producer("groups", acks=[(1.0, "a")], made=[(0.5, "a"), (0.6, "b")])
    cell = count([p], [step(0, 2.0, "a", "b")])["groups"]
    assert (cell.acknowledged, cell.lost, cell.unclaimed, cell.redone) == (1, 0, 1, 1)


def test_lease_tokens_parse_as_documented() -> None:
    assert parse_token("task:my:data:3:17:2.9f3c") is not None
    token = parse_token("task:gsm8k:0:731:1.9f3c2a")
    assert token is not None and (token.epoch, token.index, token.lease) == (0, 731, 1)
    assert parse_token("group-1") is None and parse_token("task:x:y") is None


def test_a_record_cut_short_by_a_kill_reads_up_to_its_last_whole_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    writer = Writer(path, "groups")
    writer.write(made="a")
    writer.write(ack="a")
    writer.close()
    with path.open("a") as f:
        f.write('{"t": 3.0, "ack": "b"')  # the kill landed mid-line
    got = read_producer(path)
    assert got.side == "groups" and [a for _, a in got.acks] == ["a"] and [m for _, m in got.made] == ["a"]
    headless = tmp_path / "events.jsonl"
    headless.write_text(json.dumps({"t": 1.0, "ack": ["g", 2, "x"]}) + "\n" + json.dumps({"done": 7}) + "\n")
    rollouts = read_producer(headless, "rollouts")
    assert rollouts.acks == [(1.0, ("g", 2, "x"))] and rollouts.made == [(0.0, 7)]


def test_the_trainer_s_checkpoint_is_its_record(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    assert read_trainer(path) == []
    path.write_text(
        json.dumps(
            {
                "step": 2,
                "trained": [[0, ["a"]], [1, ["b", "c"]]],
                "at": [1.0, 2.0],
                "seqs": [{"a": ["x"]}, {"b": ["y"], "c": []}],
            }
        )
    )
    assert read_trainer(path) == [Step(0, 1.0, ["a"], {"a": ["x"]}), Step(1, 2.0, ["b", "c"], {"b": ["y"], "c": []})]
    path.write_text(json.dumps({"step": 1, "trained": [[0, ["a"]]]}))  # written before records had times
    assert read_trainer(path) == [Step(0, 0.0, ["a"], {})]


def episodes(**kw: Any) -> Producer:
    return Producer("episodes", **kw)


REF = {"g": [Expected("a", ("t0", "t1"), 3), Expected("b", ("u0",), 2)]}
"""Group g as an uninterrupted run makes it: slot 0 (rollout a, turns t0 t1, 3 completions), slot 1."""


def test_episodes_token_exact_with_every_acknowledged_turn_kept_and_the_cost_counted() -> None:
    p = episodes(
        acks=[(2.0, ("g", 0, "a"))],
        turns=[(1.0, ("g", 0, 0, "t0")), (1.5, ("g", 0, 1, "t1")), (1.6, ("g", 1, 0, "u0"))],
        opens={"g": ("trek", "trek-1")},
        generated=4,
    )
    q = episodes(acks=[(3.0, ("g", 1, "b"))], turns=[(2.5, ("g", 1, 0, "u0"))], generated=3, resumed=[("g", 1, 17)])
    cell = count([p, q], [step(0, 4.0, "g", seqs={"g": ["a", "b"]})], fault_at=2.2, reference=REF)["episodes"]
    assert isinstance(cell, EpisodesCell)
    assert (cell.acknowledged, cell.lost, cell.trained_twice, cell.unclaimed) == (2, 0, 0, 0)
    assert (cell.turns_acknowledged, cell.turns_lost, cell.not_token_exact) == (3, 0, 0)  # u0 acknowledged twice
    assert cell.redone == 2  # 7 completions generated, the trained rollouts hold 5
    assert (cell.slots_resumed, cell.tokens_resumed, cell.slots_restarted) == (1, 17, 0)
    assert cell.recover_s == 1.8  # q's acknowledgement at 3.0 (after the fault at 2.2), the step at 4.0
    assert not cell.failed()


def test_a_rollout_that_is_not_the_uninterrupted_run_s_fails_and_takes_its_turns_with_it() -> None:
    p = episodes(
        acks=[(2.0, ("g", 0, "a")), (2.1, ("g", 1, "x"))],
        turns=[(1.0, ("g", 0, 0, "t0")), (1.6, ("g", 1, 0, "u0"))],
        opens={"g": ("trek", "trek-1")},
    )
    cell = count([p], [step(0, 4.0, "g", seqs={"g": ["a", "x"]})], reference=REF)["episodes"]
    assert isinstance(cell, EpisodesCell)
    assert (cell.lost, cell.not_token_exact, cell.turns_lost) == (0, 1, 1)
    assert cell.examples["not_token_exact"] == ["g:x"] and cell.examples["turns_lost"] == ["g#1:0"]
    assert cell.failed() and failed(cell.as_dict())


def test_an_acknowledged_turn_with_other_tokens_or_beyond_the_episode_is_lost() -> None:
    p = episodes(
        acks=[(2.0, ("g", 0, "a")), (2.1, ("g", 1, "b"))],
        turns=[(1.0, ("g", 0, 0, "t0")), (1.1, ("g", 0, 1, "zz")), (1.2, ("g", 1, 1, "u1")), (1.3, ("g", 2, 0, "v"))],
    )
    cell = count([p], [step(0, 4.0, "g", seqs={"g": ["a", "b"]})], reference=REF)["episodes"]
    assert isinstance(cell, EpisodesCell)
    assert (cell.not_token_exact, cell.turns_lost) == (0, 3)
    assert cell.examples["turns_lost"] == ["g#0:1", "g#1:1", "g#2:0"]


def test_an_episodes_group_never_trained_loses_its_turns_and_one_with_no_reference_is_not_token_exact() -> None:
    p = episodes(acks=[(2.0, ("h", 0, "a"))], turns=[(1.0, ("g", 0, 0, "t0"))], opens={"g": ("trek", "trek-1")})
    cell = count([p], [step(0, 4.0, "h", seqs={"h": ["a"]})], reference=REF)["episodes"]
    assert isinstance(cell, EpisodesCell)
    assert (cell.lost, cell.turns_lost, cell.not_token_exact) == (0, 1, 1)
    again = count([p], [step(0, 4.0, "h", seqs={"h": ["a"]}), step(1, 5.0, "h", seqs={"h": ["a"]})], reference=REF)
    assert again["episodes"].trained_twice == 1


def test_an_episodes_record_reads_back_its_opens_turns_generations_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    writer = Writer(path, "episodes")
    writer.write(open=["g", "trek", "trek-3"])
    writer.write(gen=8)
    writer.write(turn=["g", 1, 0, "t0"])
    writer.write(resumed=["g", 2, 40])
    writer.write(restarted=["g", 3])
    writer.write(ack=["g", 1, "a"])
    writer.close()
    worker = Writer(path, "episodes", header=False)  # a pool worker's lines: no second header
    worker.write(gen=9)
    worker.close()
    got = read_producer(path)
    assert got.side == "episodes" and got.opens == {"g": ("trek", "trek-3")} and got.generated == 2
    assert [a for _, a in got.turns] == [("g", 1, 0, "t0")] and [a for _, a in got.acks] == [("g", 1, "a")]
    assert (got.resumed, got.restarted) == ([("g", 2, 40)], 1)
