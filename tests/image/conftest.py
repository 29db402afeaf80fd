"""The image tests run only when asked for (`pytest -m image`, what `make image-test` does): they build a
container image, which plain `pytest` (the rest of `make test`) should not do a second time."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tests.image import standin
from tests.image.build import Built, build
from tests.image.podman import podman

REPORT: list[str] = []
"""Lines for the end of the run: build times, sizes."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "image" in (config.option.markexpr or ""):
        return
    skipped = [item for item in items if item.get_closest_marker("image")]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = [item for item in items if not item.get_closest_marker("image")]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if REPORT:
        terminalreporter.section("rollbuf image")
        for line in REPORT:
            terminalreporter.write_line(line)


def _podman_problem() -> str | None:
    for tool in ("podman", "mmdebstrap", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        podman("info", timeout=60)
    except (subprocess.SubprocessError, RuntimeError) as exc:
        return f"podman cannot run here: {exc}"
    return None


@pytest.fixture(scope="session")
def image() -> Built:
    """The image built from the Dockerfile. Skipped only where podman cannot run, and then never in CI or as
    root (where `make image-test` installs it: a missing podman there is a failure)."""
    problem = _podman_problem()
    if problem:
        message = f"{problem}: the image test needs podman, mmdebstrap and runc (apt-get install podman mmdebstrap runc; make image-test installs them as root)"  # noqa: E501
        if os.environ.get("CI") or os.geteuid() == 0:
            pytest.fail(message)
        pytest.skip(message)
    start = time.monotonic()
    base, fresh = standin.ensure()
    REPORT.append(f"stand-in base {base}: {'built in' if fresh else 'cached,'} {time.monotonic() - start:.1f} s")
    built = build(base)
    REPORT.append(f"image built from the Dockerfile in {built.seconds:.1f} s")
    return built
