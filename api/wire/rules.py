"""The wire's common rules: the bounds every body shares (int32 tokens, JSON-safe integers, name lengths) and
the base models that enforce them (integral floats accepted as integers, text without NULs or lone surrogates,
unknown fields refused in requests). Imports only pydantic: `api.wire.schema` and `api.wire.producers` build on it."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator

# Token ids and masks travel as int32 on the binary path and in the store.
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
SAFE_INT_MAX = 2**53 - 1
"""Bound of step counts and ids: stored as JSON, and exact in a double (so in every JSON parser)."""
MASK_IGNORE = -100
"""Mask value of a position the trainer does not train on (the prompt)."""
FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite float32: per-token floats are stored as float32."""
GROUP_ID_MAX = 200
"""Longest group id, on both paths (`ScoredData.group_id` here, `api.ingest.binary_groups` on msgpack)."""
PRODUCER_ID_MAX = 200
"""Longest producer id, on heartbeats and groups (both paths)."""
ENV_NAME_MAX = 200
"""Longest env name (`desired_name`): every view and counter carries it."""


class _Wire(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="ignore")


def integral_floats(value: Any) -> Any:
    """JSON Schema counts `8.0` as an integer, so rollbuf does: integral floats in an integer field (or in
    lists of them, at any depth) become ints. Everything else is left to strict validation."""
    if type(value) is float and value.is_integer():
        return int(value)
    if isinstance(value, list) and any(type(x) is float or isinstance(x, list) for x in value):
        return [integral_floats(x) for x in value]
    return value


class _Integers(_Wire):
    """Integral floats in integer fields become ints (`integral_floats`), before any other validation."""

    integer_fields: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="before")
    @classmethod
    def _integers(cls, value: Any, info: ValidationInfo) -> Any:
        return integral_floats(value) if info.field_name in cls.integer_fields else value


class _Text(BaseModel):
    """A model whose strings are stored and printed: each must be valid Unicode (JSON's `\\ud800` escape
    decodes to a lone surrogate that no store, log or JSON reply can hold: a 422, not a 500)."""

    @field_validator("*", mode="after")
    @classmethod
    def _unicode(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("must be valid Unicode (no lone surrogates)") from None
        return value


class _Request(_Integers):
    """A request body FastAPI validates, strictly: a string or boolean where a number belongs is a 422, not
    coerced, so the OpenAPI description is exact. Scored groups are validated the same way by
    `api.http.body.validate`, while clients may still build a `ScoredData` from tuples or numpy ints."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="ignore", strict=True)


# Per-token values and rows, as the OpenAPI description states them. They are checked by `api.ingest.validation`
# on arrays, once for both ways a group is read (JSON straight into arrays, or through this schema) and the
# binary path, so the schema only describes them.
TokenId = Annotated[int, WithJsonSchema({"type": "integer", "minimum": 0, "maximum": INT32_MAX})]
MaskValue = Annotated[
    int,
    WithJsonSchema({"anyOf": [{"type": "integer", "minimum": INT32_MIN, "maximum": INT32_MAX}, {"type": "boolean"}]}),
]
"""A mask value; `true`/`false` (verl's Atropos recipe sends boolean masks, which Atropos coerces) is 1/0."""
WeightVersion = Annotated[int, WithJsonSchema({"type": "integer", "minimum": 0, "maximum": INT32_MAX})]
"""A token's weights version: a trainer step, stored as int32 beside the token."""
TokenFloat = Annotated[float, WithJsonSchema({"type": "number", "minimum": -FLOAT32_MAX, "maximum": FLOAT32_MAX})]
NON_EMPTY = Field(json_schema_extra={"minItems": 1})
Message = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "required": ["role", "content"], "additionalProperties": True}),
]
