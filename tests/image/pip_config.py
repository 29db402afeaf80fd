"""The host's pip configuration, handed to the image build: the build installs from the same index, with the
same certificate chain, find-links and constraints as the host, while the Dockerfile stays what a user
elsewhere runs (nothing machine-specific is baked into it or into the image).

`pip config list` (files and PIP_* variables, in pip's precedence) becomes one pip.conf mounted at
/etc/pip.conf for the build's RUN steps only, with the local files and directories it names mounted read-only
at the same paths."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

PATH_KEYS = frozenset({"cert", "client-cert", "constraint", "find-links", "index-url", "extra-index-url", "build"})
"""Settings whose values may name local files or directories (plain paths or file:// URLs)."""


@dataclass(frozen=True)
class PipConfig:
    sections: dict[str, dict[str, str]]
    """section ("global", "install", ...) -> key -> value, the last source winning as in pip."""

    def text(self) -> str:
        lines = []
        for section, values in self.sections.items():
            lines.append(f"[{section}]")
            lines += [f"{key} = {value}" for key, value in values.items()]
        return "\n".join(lines) + "\n"

    def local_paths(self) -> list[str]:
        """Absolute local paths the settings name, in order, once each."""
        out: list[str] = []
        for values in self.sections.values():
            for key, value in values.items():
                if key not in PATH_KEYS:
                    continue
                for token in value.split():
                    path = unquote(urlparse(token).path).rstrip("/") if token.startswith("file:") else token
                    if key.endswith("index-url") and path.endswith("/simple"):
                        path = path.removesuffix("/simple")  # a local index's pages link to files beside it
                    if path.startswith("/") and path not in out:
                        out.append(path)
        return out


def parse(listing: str) -> PipConfig:
    """`pip config list` lines: `global.cert='/path'` from files, `:env:.find-links='/dir'` from PIP_*
    variables (they apply to every command: section global), later lines overriding earlier ones."""
    sections: dict[str, dict[str, str]] = {}
    for line in listing.splitlines():
        name, sep, quoted = line.partition("=")
        if not sep or "." not in name:
            continue
        section, key = name.rsplit(".", 1)
        if section in (":env:", ""):
            section = "global"
        value = ast.literal_eval(quoted)
        sections.setdefault(section, {})[key] = value if isinstance(value, str) else str(value)
    return PipConfig(sections)


def host() -> PipConfig:
    """What pip on this host would use: the test's own interpreter's pip, with its environment."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True, env=os.environ
    )
    return parse(out.stdout)
