"""A stand-in for `python:3.11-slim` where no registry can be reached: Debian bookworm (which ships Python
3.11) built with mmdebstrap from the host's apt sources and imported into podman.

It differs from the official image in where Python lives (/usr/bin, linked into /usr/local/bin as the
official image has it) and in size (Debian's python3 pulls in perl); what the Dockerfile relies on, `python`
with `venv` and `pip`, `groupadd`/`useradd`, is the same. It is cached in podman's image store under a tag
keyed by a hash of this recipe: a changed recipe builds a new one (and drops the old), an unchanged one
costs nothing. Debian updates reach it only when the recipe changes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import tempfile
from pathlib import Path

from tests.image.podman import podman

REPOSITORY = "localhost/rollbuf-python-standin"
MMDEBSTRAP = [
    "--variant=apt",
    "--include=python3,python3-venv,python3-pip,ca-certificates",
    # What python:3.11-slim leaves out too: documentation, manuals, translations.
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/info/*",
    # As in python:3.11-slim: pip may install into the system Python, `python` and `pip` are on the PATH.
    '--customize-hook=rm -f "$1"/usr/lib/python3.11/EXTERNALLY-MANAGED',
    '--customize-hook=ln -s /usr/bin/python3 "$1"/usr/local/bin/python',
    '--customize-hook=ln -s /usr/bin/pip3 "$1"/usr/local/bin/pip',
    "bookworm",
]
CHANGES = ["ENV LANG=C.UTF-8", 'CMD ["python3"]']


def tag() -> str:
    key = hashlib.sha256(json.dumps([MMDEBSTRAP, CHANGES]).encode()).hexdigest()[:12]
    return f"{REPOSITORY}:3.11-slim-{key}"


def ensure() -> tuple[str, bool]:
    """The stand-in's tag, built unless this recipe's is already in podman's store; and whether it was built."""
    wanted = tag()
    if podman("image", "exists", wanted, check=False).returncode == 0:
        return wanted, False
    with tempfile.TemporaryDirectory(prefix="rollbuf-standin-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        subprocess.run(["mmdebstrap", "--quiet", *MMDEBSTRAP, str(rootfs)], check=True, timeout=600)
        changes = [arg for change in CHANGES for arg in ("--change", change)]
        podman("import", "--quiet", *changes, str(rootfs), wanted)
    for old in podman("images", "--format", "{{.Repository}}:{{.Tag}}", REPOSITORY).stdout.split():
        if old != wanted:
            podman("rmi", old, check=False)  # an earlier recipe's stand-in: nothing else uses it
    return wanted, True
