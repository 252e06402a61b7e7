"""The suite keeps to itself: no test reads or writes the user's Prefect home, model-spec cache or Prefect server."""

import os
import tempfile
from pathlib import Path

from mergeflow.deployments.server import configured_api_url, kept_up_api_url, prefect_home
from mergeflow.spec import cache as spec_cache
from tests.cli_runs import without_a_server


def is_temporary(path: str | Path) -> bool:
    return Path(path).resolve().is_relative_to(Path(tempfile.gettempdir()).resolve())


def test_the_suite_has_a_prefect_home_of_its_own():
    from prefect.settings import get_current_settings

    assert is_temporary(prefect_home())
    assert Path(get_current_settings().home).resolve() == prefect_home().resolve()
    assert prefect_home().resolve() != (Path.home() / ".prefect").resolve()


def test_the_suite_has_a_model_spec_cache_of_its_own():
    assert is_temporary(os.environ[spec_cache.CACHE_DIR_VARIABLE])


def test_a_command_run_without_a_server_finds_none_of_the_users():
    environment = without_a_server()

    assert "PREFECT_API_URL" not in environment and "PREFECT_PROFILES_PATH" not in environment
    assert is_temporary(environment["PREFECT_HOME"])
    assert configured_api_url() is None or "PREFECT_API_URL" in os.environ
    assert kept_up_api_url() is None
