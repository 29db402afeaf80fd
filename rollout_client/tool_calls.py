"""Moved to `rollout_client.chat.tool_calls`: importing this path warns once and gives that module."""

from typing import TYPE_CHECKING

from rollout_client._moved import moved

if TYPE_CHECKING:
    from rollout_client.chat.tool_calls import *  # noqa: F403

moved(__name__)
