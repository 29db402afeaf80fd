"""Moved to `rollout_client.runner.stats`: importing this path warns once and gives that module."""

from typing import TYPE_CHECKING

from rollout_client._moved import moved

if TYPE_CHECKING:
    from rollout_client.runner.stats import *  # noqa: F403

moved(__name__)
