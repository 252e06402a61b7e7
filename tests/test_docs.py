"""The documentation agrees with the code: every error class has a troubleshooting entry, the versions table says
what pyproject.toml allows, the Megatron table covers every fixture's family, and CI runs the README's test command."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from mergeflow import errors
from tests.conftest import MEGATRON_FIXTURE_SPECS

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def error_classes() -> list[type]:
    """MergeflowError and every class below it."""
    found, pending = [], [errors.MergeflowError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


def table_rows(page: Path) -> list[list[str]]:
    """The cells of every table row of a Markdown page (header and separator rows included)."""
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in page.read_text().splitlines() if line.startswith("|")]  # fmt: skip


def versions_table() -> dict[str, str]:
    """Package (canonical name) -> the "pyproject.toml allows" cell of docs/versions.md's first table."""
    return {canonicalize_name(row[0]): row[2] for row in table_rows(DOCS / "versions.md") if len(row) == 3}


def allowed_specifier(cell: str) -> SpecifierSet:
    """`>=3.4,<4` from a cell such as "`>=3.4,<4` (extra `ray`)"; "any" is the empty set."""
    return SpecifierSet(cell.split("`")[1] if cell.startswith("`") else "")


def pyproject_requirements(*extras: str) -> list[Requirement]:
    """The runtime dependencies, or with `extras` named, those extras' requirements."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = [line for extra in extras for line in project["optional-dependencies"][extra]] if extras else project["dependencies"]
    return [Requirement(line) for line in lines]


def test_every_error_class_has_a_troubleshooting_entry():
    headings = set(re.findall(r"^## (\w+)$", (DOCS / "troubleshooting.md").read_text(), flags=re.MULTILINE))

    assert {cls.__name__ for cls in error_classes()} - headings == set()


def test_versions_table_allows_what_pyproject_allows():
    table = versions_table()

    for requirement in pyproject_requirements() + pyproject_requirements("dask", "ray"):
        name = canonicalize_name(requirement.name)
        assert name in table, f"docs/versions.md has no row for {requirement.name}"
        assert allowed_specifier(table[name]) == requirement.specifier, requirement.name


def test_versions_table_pins_the_fixture_writers_as_the_test_extra_does():
    table = versions_table()
    listed = [r for r in pyproject_requirements("test") if canonicalize_name(r.name) in table]

    assert {canonicalize_name(r.name) for r in listed} >= {"megatron-core", "mbridge"}
    assert all(allowed_specifier(table[canonicalize_name(r.name)]) == r.specifier for r in listed)


def test_versions_table_gives_the_python_pyproject_requires():
    requires_python = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]

    assert allowed_specifier(versions_table()["python"]) == SpecifierSet(requires_python)


def test_megatron_table_covers_every_fixture_family():
    families = {row[0].strip("`") for row in table_rows(DOCS / "megatron.md")}

    assert {spec.model for spec in MEGATRON_FIXTURE_SPECS} - families == set()


def test_ci_runs_the_readme_test_command():
    readme_commands = [line for line in (REPO / "README.md").read_text().splitlines() if "python -m pytest" in line]
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()

    assert readme_commands
    assert all(command in ci_lines for command in readme_commands)
