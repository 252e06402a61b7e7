"""Installed, the project is one importable name, `mergeflow`, with the repo's tasks/, flows/ and deployments/
folders inside it."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.xdist_group("wheel")  # one wheel build: builds of one source tree at once collide


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> list[str]:
    """The files of a wheel built from this checkout."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO_ROOT)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = out.glob("mergeflow-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_a_fresh_install_has_exactly_one_top_level_name(wheel_names):
    top_level = {name.split("/")[0] for name in wheel_names if ".dist-info/" not in name}

    assert top_level == {"mergeflow"}


@pytest.mark.parametrize("folder", ["tasks", "flows", "deployments"])
def test_the_pipeline_folders_are_installed_inside_the_package(wheel_names, folder):
    expected = {f"mergeflow/{folder}/{path.name}" for path in (REPO_ROOT / folder).glob("*.py")}

    assert expected <= set(wheel_names)


def test_every_engine_module_is_installed(wheel_names):
    expected = {str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "mergeflow").rglob("*.py")}

    assert expected <= set(wheel_names)


def test_python_dash_m_mergeflow_is_the_command():
    shown = subprocess.run([sys.executable, "-m", "mergeflow", "--help"], capture_output=True, text=True, check=True)

    assert "merge" in shown.stdout and "serve" in shown.stdout


def test_the_wheel_holds_no_test_fixture_writers(wheel_names):
    fixture_writers = {path.name for path in (REPO_ROOT / "tests" / "writers").glob("*.py")} - {"__init__.py"}

    assert not [name for name in wheel_names if name.rsplit("/", 1)[-1] in fixture_writers or name.startswith("tests/")]
