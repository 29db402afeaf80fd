"""The project's Dockerfile built as it stands, on the stand-in base, with the host's pip configuration
mounted for the build only (tests/image/pip_config.py)."""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.image import pip_config
from tests.image.podman import LIMITS, podman

ROOT = Path(__file__).resolve().parents[2]
TAG = "localhost/rollbuf-image-test:latest"
"""One tag, rebuilt each run: the build steps it shares with the next build (the dependencies) are its cache."""
STATE = Path("/var/cache/rollbuf-image/build-ids.json")
"""The images (steps included) the last build made or used, outside any clone: a build removes its
predecessor's that it no longer uses, so that repeated runs do not fill the disk with stale build caches."""
STEP_ID = re.compile(r"^--> (?:Using cache )?([0-9a-f]{11,64})\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Built:
    tag: str
    id: str
    seconds: float


def build(base: str) -> Built:
    """`--format docker`: an OCI image has no HEALTHCHECK, and podman drops it unless asked for Docker's
    format. `--network=host`: the build's downloads go out as the host's do."""
    config = pip_config.host()
    mounts = [f"{path}:{path}:ro" for path in config.local_paths() if os.path.exists(path)]
    with tempfile.NamedTemporaryFile("w", prefix="rollbuf-pip-", suffix=".conf") as conf:
        conf.write(config.text())
        conf.flush()
        os.chmod(conf.name, 0o644)
        volumes = [arg for m in [f"{conf.name}:/etc/pip.conf:ro", *mounts] for arg in ("--volume", m)]
        start = time.monotonic()
        flags = ["--format", "docker", "--pull=never", "--network=host", *LIMITS, *volumes]
        out = podman(
            "build",
            *flags,
            "--build-arg",
            f"PYTHON_IMAGE={base}",
            "--tag",
            TAG,
            "--file",
            str(ROOT / "Dockerfile"),
            str(ROOT),
        )
        seconds = time.monotonic() - start
    image_id = podman("image", "inspect", "--format", "{{.Id}}", TAG).stdout.strip()
    _forget_stale({i[:11] for i in STEP_ID.findall(out.stdout)} | {image_id[:11]})
    return Built(TAG, image_id, seconds)


def _forget_stale(used: set[str]) -> None:
    previous = set(json.loads(STATE.read_text())) if STATE.exists() else set()
    for stale in previous - used:
        podman("rmi", stale, check=False)  # already gone, or in use by a container: fine either way
    try:
        STATE.parent.mkdir(parents=True, exist_ok=True)
        STATE.write_text(json.dumps(sorted(used)))
    except PermissionError:
        pass  # not root: podman's store is the user's own, and its cache is theirs to prune
