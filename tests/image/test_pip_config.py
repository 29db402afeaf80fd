"""The host's pip configuration as the image build receives it (pure: no podman, runs in plain pytest)."""

from __future__ import annotations

from tests.image.pip_config import parse

LISTING = """\
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple https://mirror.example/simple'
global.find-links='/opt/wheels'
install.no-compile='true'
:env:.default-timeout='180'
:env:.find-links='/opt/more-wheels'
"""


def test_every_source_becomes_one_file_the_environment_winning() -> None:
    config = parse(LISTING)
    assert config.sections["global"]["find-links"] == "/opt/more-wheels"
    assert config.sections["global"]["default-timeout"] == "180"
    assert config.sections["install"] == {"no-compile": "true"}
    text = config.text()
    assert text.startswith("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
    assert "[install]\nno-compile = true\n" in text


def test_local_paths_are_the_files_and_directories_it_names() -> None:
    assert parse(LISTING).local_paths() == [
        "/etc/ssl/certs/ca-certificates.crt",
        "/etc/xdg/pip/constraints.txt",
        "/opt/pypi",  # a local index's pages link to files beside its simple/ directory
        "/opt/pypi-more",
        "/opt/more-wheels",
    ]


def test_nothing_configured_is_an_empty_file() -> None:
    config = parse("")
    assert config.text() == "\n" and config.local_paths() == []
