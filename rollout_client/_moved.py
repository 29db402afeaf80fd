"""Deprecated module paths of `rollout_client`, the ones users and the docs import: each names a module that
now lives in a subpackage (runner, workers, chat, leases, verifiers). The old path stays a small module of its
own, so that an import of it keeps working and says where to import from instead: one DeprecationWarning, then
the new module itself. Delete an entry and its module once no release documents the old path."""

from __future__ import annotations

import importlib
import sys
import warnings

MOVED = {
    "rollout_client.chat_examples": "rollout_client.chat.examples",
    "rollout_client.coalescing": "rollout_client.runner.coalescing",
    "rollout_client.failures": "rollout_client.runner.failures",
    "rollout_client.following": "rollout_client.runner.following",
    "rollout_client.handle": "rollout_client.runner.handle",
    "rollout_client.ipc": "rollout_client.workers.ipc",
    "rollout_client.leased_tasks": "rollout_client.leases.tasks",
    "rollout_client.open_groups": "rollout_client.leases.open_groups",
    "rollout_client.recycling": "rollout_client.workers.recycling",
    "rollout_client.stats": "rollout_client.runner.stats",
    "rollout_client.timeouts": "rollout_client.runner.timeouts",
    "rollout_client.tool_calls": "rollout_client.chat.tool_calls",
    "rollout_client.tools": "rollout_client.chat.tools",
    "rollout_client.verifiers_mapping": "rollout_client.verifiers.mapping",
    "rollout_client.verifiers_tasks": "rollout_client.verifiers.tasks",
}
"""Old module path -> the module that now holds its code."""


def moved(old: str) -> None:
    """Make `old` the module it moved to (the same objects, so a patch through either path patches both), with
    one DeprecationWarning, attributed to the line that imported it; later imports find the new module cached."""
    new = MOVED[old]
    warnings.warn(f"{old} has moved to {new}: import from {new}", DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
