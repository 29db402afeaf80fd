"""schemathesis hooks (loaded with SCHEMATHESIS_HOOKS=tests.openapi_hooks) for the rules OpenAPI cannot state.

The description states every rule on one value (types, ranges, `minItems`, `maxItems`, required keys), with this
server's settings where a bound is one (`task_page_size`, `rollout_max_deadline_s`, `max_world_size`). A request
the schema calls valid that the server's state refuses is answered 404 (something it names is unknown) or 409 (a
conflict with the state) on rollbuf's own routes, which schemathesis accepts, so they need no hook. What is left
are rules that tie values of one request together, which the schema can only describe in words, and the Atropos
routes' refusals of state, whose 422s docs/atropos-differences.md documents. These hooks make generated requests
keep those rules. They only ever replace a value that is already valid by the schema with another valid one, and
never add a field, so a request that breaks the schema still does (and is still expected to be refused). The rules:

- a group's `masks`, `scores`, per-token float fields and `token_weight_versions` have one entry per sequence,
  each row as long as its tokens' row (versions at most the trainer's step: 0 here); `distill_*` rows likewise (set
  to null here rather than built);
- Atropos routes: `env_id` names a registered environment (null here), `policy_step` is at most the trainer's
  step (0), `producer_id` is printable text (null here otherwise); `group_size` is at most the trainer's
  `batch_size` (the test registers the largest, 2^31 - 1); `/status-env`: `env_id` comes as `?env_id=` or as the
  JSON body (0 here when neither);
- `/batch`: `rank` and `world_size` come together, with `rank < world_size`;
- `/tasks/datasets`: `path` or `tasks`, not both (`path` null here when both); `levels` come with order
  `weighted` only, and then every task names one (here: no levels, and a weighted order becomes shuffled);
- `/rollouts/*`: `producer_id` is printable text (`p` here otherwise); `/rollouts/open`: `min_group_size` is
  at most `group_size` (null here otherwise); `/rollouts/post` and `/rollouts/turn`: `masks`,
  `inference_logprobs` and `token_weight_versions` have one entry per token (the tokens themselves, null, and 0
  each, here), and a post's `tokens` are empty only with `after_turns` (`[1]` here otherwise); a slot's turns all
  send `token_weight_versions` or none do (none here), and a turn's `tool_results`
  JSON prints back (as free-form fields, below);
- free-form fields (`overrides`, `images`, tasks, ...) hold only what JSON prints back: integers within 64 bits,
  nesting at most 32 deep (null here otherwise).
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard

import schemathesis
from schemathesis.core import NOT_SET
from schemathesis.core.parameters import ParameterLocation

from api.errors import InvalidData
from api.ingest.validation import check_producer_id
from api.run.printable import check_printable
from api.wire.rollouts import SLOTS_MAX

OPEN_GROUP = "conformance"
"""The group tests/integration/test_openapi_conformance.py opens: a turn names it, to reach past the 404 (test data,
as its config's for the query routes)."""
PER_TOKEN_FLOATS = ("advantages", "ref_logprobs", "inference_logprobs")
FREE_FORM = ("messages", "overrides", "group_overrides", "generation_params", "images")
SAFE_INT_MAX = 2**53 - 1
INT32 = (-(2**31), 2**31 - 1)
FLOAT32_MAX = 3.4028234663852886e38


def _int(value: Any, low: int, high: int) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and float(value).is_integer()
        and low <= value <= high
    )


def _number(value: Any, bound: float = math.inf) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and abs(value) <= bound
    )


def _ints(row: Any) -> TypeGuard[list[int]]:
    """A non-empty list of integers of any size (an integral float, `438.0`, is an integer to JSON Schema)."""
    return isinstance(row, list) and bool(row) and all(_integral(v) for v in row)


def _integral(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


def _rows(value: Any, ok: Any) -> TypeGuard[list[list[Any]]]:
    """A non-empty list of non-empty rows whose values all pass `ok`: valid by the schema."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(row, list) and row and all(ok(v) for v in row) for row in value)
    )


def _align_group(group: Any) -> None:
    if not isinstance(group, dict):
        return
    if _int(group.get("env_id"), -SAFE_INT_MAX, SAFE_INT_MAX):
        group["env_id"] = None
    if _int(group.get("policy_step"), 0, SAFE_INT_MAX):
        group["policy_step"] = 0
    if isinstance(group.get("producer_id"), str):  # printable text only (api.ingest.validation.check_producer_id)
        try:
            check_producer_id(group["producer_id"])
        except InvalidData:
            group["producer_id"] = None
    tokens = group.get("tokens")
    if not _rows(tokens, lambda v: _int(v, 0, INT32[1])):
        return
    if _rows(group.get("masks"), lambda v: isinstance(v, bool) or _int(v, *INT32)):
        group["masks"] = [list(row) for row in tokens]  # the token ids themselves: valid under any mask rule
    scores = group.get("scores")
    if isinstance(scores, list) and scores and all(_number(v) for v in scores):
        group["scores"] = [scores[i % len(scores)] for i in range(len(tokens))]
    for name in PER_TOKEN_FLOATS:
        value = group.get(name)
        if isinstance(value, list) and all(
            isinstance(r, list) and all(_number(v, FLOAT32_MAX) for v in r) for r in value
        ):
            group[name] = [[0.5] * len(row) for row in tokens]
    versions = group.get("token_weight_versions")
    if isinstance(versions, list) and all(
        isinstance(r, list) and all(_int(v, 0, INT32[1]) for v in r) for r in versions
    ):
        group["token_weight_versions"] = [[0] * len(row) for row in tokens]
    for name in ("distill_token_ids", "distill_logprobs"):
        if group.get(name) is not None:
            group[name] = None
    for name in FREE_FORM:  # any JSON by the schema, but only what JSON prints back (api.ingest.validation)
        if name in group and group[name] is not None:
            try:
                check_printable({name: group[name]})
            except InvalidData:
                group[name] = None


def _printable_producer(body: dict[str, Any]) -> None:
    """A producer id is printable text (`check_producer_id`: what the ledger stores and every view prints)."""
    try:
        check_producer_id(body["producer_id"])
    except InvalidData:
        body["producer_id"] = "p"


def _printable(value: Any) -> Any:
    try:
        check_printable({"task": value})
    except InvalidData:
        return None
    return value


def _align_body(path: str, body: Any) -> None:
    if path in ("/scored_data", "/scored_data_list"):
        for group in body if isinstance(body, list) else [body]:
            _align_group(group)
    elif path in ("/tasks/datasets", "/tasks/pages") and isinstance(body, dict):
        if body.get("path") is not None and body.get("tasks") is not None:
            body["path"] = None
        if "levels" in body or body.get("order") == "weighted":
            body["levels"] = None
            if body.get("order") == "weighted":
                body["order"] = "shuffled"
        if isinstance(body.get("tasks"), list):
            body["tasks"] = [_printable(t) for t in body["tasks"]]
    elif path.startswith("/rollouts/") and isinstance(body, dict) and isinstance(body.get("producer_id"), str):
        _printable_producer(body)
    if path == "/rollouts/open" and isinstance(body, dict):
        least, size = body.get("min_group_size"), body.get("group_size")
        if _int(least, 1, SLOTS_MAX) and _int(size, 1, SLOTS_MAX) and int(least) > int(size):  # type: ignore[arg-type]
            body["min_group_size"] = None
        if "task" in body:
            body["task"] = _printable(body["task"])
    elif path in ("/rollouts/post", "/rollouts/turn") and isinstance(body, dict):
        if body.get("tokens") == [] and body.get("after_turns") is not True:  # empty only after a slot's turns
            body["tokens"] = [1]
        tokens, masks = body.get("tokens"), body.get("masks")
        if _ints(tokens) and isinstance(masks, list) and all(_integral(v) for v in masks):  # [] is valid too
            body["masks"] = list(tokens)
        if isinstance(body.get("inference_logprobs"), list):
            body["inference_logprobs"] = None
        versions = body.get("token_weight_versions")
        if _ints(tokens) and isinstance(versions, list) and all(_int(v, 0, INT32[1]) for v in versions):
            body["token_weight_versions"] = [0] * len(tokens)
    if path == "/rollouts/turn" and isinstance(body, dict):
        if "tool_results" in body:
            body["tool_results"] = _printable(body["tool_results"])
        if isinstance(body.get("token_weight_versions"), list):
            body["token_weight_versions"] = None
        if isinstance(body.get("group_id"), str):
            body["group_id"] = OPEN_GROUP


def _query_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    _align_body(context.operation.path, body)
    return body


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    path = case.operation.path
    if path in (
        "/scored_data",
        "/scored_data_list",
        "/tasks/datasets",
        "/tasks/pages",
        "/rollouts/open",
        "/rollouts/post",
        "/rollouts/turn",
    ):
        _align_body(path, case.body)
        if case.meta is not None:
            case.meta.mark_dirty(ParameterLocation.BODY)
    elif path == "/batch" and isinstance(case.query, dict):
        query = case.query
        rank, world = _query_int(query.get("rank")), _query_int(query.get("world_size"))
        if rank is not None and rank >= 0 and "world_size" not in query:
            query["world_size"] = rank + 1
        elif world is not None and world >= 1 and "rank" not in query:
            query["rank"] = 0
        elif rank is not None and world is not None and 0 <= world <= rank:
            query["rank"] = rank % world if world else rank
    elif path == "/status-env" and (case.query or {}).get("env_id") is None and case.body in (None, NOT_SET):
        case.body = {"env_id": 0}
    return case
