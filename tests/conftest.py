"""Session-wide fixtures: real FSDP checkpoints (written once) and a real Prefect server."""

import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from mergeflow.spec import cache as spec_cache

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ[spec_cache.CACHE_DIR_VARIABLE] = tempfile.mkdtemp(prefix="mergeflow-cache-")
os.environ.pop("PREFECT_API_URL", None)  # the user's server and profiles stay out of the suite
os.environ.pop("PREFECT_UI_API_URL", None)
os.environ.pop("PREFECT_PROFILE", None)
os.environ.pop("PREFECT_PROFILES_PATH", None)
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="mergeflow-prefect-home-")
os.environ.pop("RAY_ADDRESS", None)  # so is the user's Ray cluster
os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="mf-ray-")  # short: Ray's socket paths must fit in 107 bytes
os.environ["RAY_AUTH_MODE"] = "disabled"  # else a local Ray writes a token to ~/.ray (the suite's Ray is on 127.0.0.1)

import pytest
from filelock import FileLock

from mergeflow.demo.fsdp import Fixture, FixtureSpec, fixture_at, write_fixtures
from tests import side_venvs
from tests.writers.automodel import (
    AutomodelFixture,
    AutomodelFixtureSpec,
    automodel_fixture_at,
    write_automodel_fixtures,
)
from tests.writers.megatron import (
    MegatronFixture,
    MegatronFixtureSpec,
    megatron_fixture_at,
    write_megatron_fixtures,
)
from tests.writers.torchtitan import (
    TorchTitanFixture,
    TorchTitanFixtureSpec,
    torchtitan_fixture_at,
    write_torchtitan_fixtures,
)
from tests.writers.veomni import VeomniFixture, VeomniFixtureSpec, veomni_fixture_at, write_veomni_fixtures

REPO = Path(__file__).resolve().parents[1]
GENERATION_CONFIG = {
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.9,
    "eos_token_id": 1,
    "bos_token_id": 2,
}

FIXTURE_SPECS = [
    FixtureSpec("qwen2-ws1", world_size=1),
    FixtureSpec("qwen2-ws2", world_size=2, generation_config=GENERATION_CONFIG),
    FixtureSpec("qwen2-dp-shard-ws2", world_size=2, mesh_dim_names=("dp_shard",), dtype="bf16"),
    FixtureSpec("qwen2-dp-shard-sp-ws2", world_size=2, mesh_dim_names=("dp_shard_sp",)),  # VeOmni's mesh with Ulysses
    FixtureSpec("value-ws2", model="qwen2-value", world_size=2, tie=False, role="critic"),
    FixtureSpec("llama-untied-ws3", model="llama", world_size=3, tie=False),
    FixtureSpec("qwen2-fsdp1-ws3", world_size=3, fsdp_version=1, dtype="bf16"),
    FixtureSpec("qwen2-untied-ws4", world_size=4, tie=False),
    FixtureSpec("qwen2-hsdp-2x2", world_size=4, mesh_shape=(2, 2), mesh_dim_names=("ddp", "fsdp")),
    FixtureSpec("qwen3moe-ws2", model="qwen3_moe", world_size=2, tie=False),
    FixtureSpec("mixtral-ws3", model="mixtral", world_size=3, tie=False),
    FixtureSpec("qwen2moe-fsdp1-ws2", model="qwen2_moe", world_size=2, fsdp_version=1, tie=False),
    FixtureSpec("qwen25vl-ws2", model="qwen2_5_vl", world_size=2, tie=False),
    FixtureSpec("qwen25vl-tied-fsdp1-ws3", model="qwen2_5_vl", world_size=3, fsdp_version=1),
    FixtureSpec("qwen3vlmoe-ws2", model="qwen3_vl_moe", world_size=2, tie=False),
    FixtureSpec(
        "llama-fsdp1-hsdp-2x2",
        model="llama",
        world_size=4,
        fsdp_version=1,
        mesh_shape=(2, 2),
        mesh_dim_names=("ddp", "fsdp"),
    ),
]
WRITTEN = ".written"
"""Marks a fixture directory whose writing finished."""
FIXTURE_NAMES = [spec.name for spec in FIXTURE_SPECS]

LORA = {"r": 4, "lora_alpha": 16, "task_type": "CAUSAL_LM"}
LORA_FIXTURE_SPECS = [
    FixtureSpec(  # ranks differ per module; an embedding is adapted
        "lora-ws2",
        tie=False,
        lora={**LORA, "target_modules": ["q_proj", "v_proj", "down_proj", "embed_tokens"], "rank_pattern": {"v_proj": 2}},
    ),
    FixtureSpec(
        "lora-no-meta-fsdp1-ws2",
        fsdp_version=1,
        tie=False,
        lora={**LORA, "target_modules": ["q_proj", "k_proj"]},
        lora_meta=False,
    ),
    FixtureSpec(
        "dora-llama-ws3",
        model="llama",
        world_size=3,
        lora={**LORA, "target_modules": ["q_proj", "o_proj", "gate_proj"], "use_dora": True},
    ),
    FixtureSpec("lora-only-ws2", lora={**LORA, "target_modules": ["q_proj", "up_proj"]}, lora_only=True),
    FixtureSpec("lora-moe-ws2", model="qwen3_moe", tie=False, lora={**LORA, "target_modules": ["q_proj", "o_proj"]}),
    FixtureSpec(  # a vision-language model, saved under other names than it holds
        "lora-vl-ws2", model="qwen2_5_vl", tie=False, lora={**LORA, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    ),
    FixtureSpec(
        "lora-value-ws2",
        model="qwen2-value",
        tie=False,
        role="critic",
        lora={**LORA, "target_modules": ["q_proj", "v_proj"], "task_type": "TOKEN_CLS"},
    ),
]
LORA_FIXTURE_NAMES = [spec.name for spec in LORA_FIXTURE_SPECS]
REMOTE_CODE_SPEC = FixtureSpec("remote-code-ws2", tie=False, remote_code=True)
WIDE_SPEC = FixtureSpec("qwen2-wide-ws2", model="qwen2-wide", world_size=2, tie=False)
"""Weights of several whole 128×128 FP8 blocks (attention), and MLP weights of a partial block beside whole ones."""


def uses(item: pytest.Item, fixture: str) -> bool:
    """Whether the test needs the fixture (directly or through another)."""
    return fixture in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the vLLM test from the middle of the run: its venv is built by then, and, as the last test it was,
    its minute and a half on both cores left the other worker idle at the end."""
    vllm = [item for item in items if uses(item, "vllm_python")]
    rest = [item for item in items if item not in vllm]
    middle = len(rest) // 2
    items[:] = [*rest[:middle], *vllm, *rest[middle:]]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building each side venv a collected test needs, so that it is ready by the time that runs."""
    session.config.stash[side_venvs.BUILDING] = {
        venv.name: building
        for venv in side_venvs.SIDE_VENVS.values()
        if any(uses(item, venv.fixture) for item in session.items)
        if (building := venv.start_building()) is not None
    }


def pytest_sessionfinish(session: pytest.Session) -> None:
    for building in session.config.stash.get(side_venvs.BUILDING, {}).values():
        building.end()


def written_once(tmp_path_factory: pytest.TempPathFactory, name: str, write: Callable[[Path], object]) -> Path:
    """The directory `name` that `write` fills once for the whole run: under pytest-xdist, the first worker
    to ask writes it and the others wait for it."""
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent
    directory = root / name
    with FileLock(f"{directory}.lock"):
        if not (directory / WRITTEN).exists():
            shutil.rmtree(directory, ignore_errors=True)
            write(directory)
            (directory / WRITTEN).touch()
    return directory


@pytest.fixture(scope="session", autouse=True)
def fixture_sets_written_side_by_side(request: pytest.FixtureRequest) -> None:
    """Under pytest-xdist, the second worker starts by writing the Megatron fixtures while the others write the
    FSDP ones, instead of all waiting for the FSDP ones first."""
    needed = any(uses(item, "megatron_fixtures") for item in request.session.items)
    if needed and os.environ.get("PYTEST_XDIST_WORKER") == "gw1":
        request.getfixturevalue("megatron_fixtures")


def written_by_world_size(tmp_path_factory, name: str, specs: list, write: Callable, locate: Callable) -> dict:
    """Each world size's fixtures, written once per run (`written_once`): by increasing world size on the first
    pytest-xdist worker and decreasing on the second, so that two workers needing the same set share its writing."""
    groups: dict[int, list] = {}
    for spec in specs:
        groups.setdefault(spec.world_size, []).append(spec)
    found = {}
    for world_size in sorted(groups, reverse=os.environ.get("PYTEST_XDIST_WORKER") == "gw1"):
        group = groups[world_size]
        root = written_once(tmp_path_factory, f"{name}-ws{world_size}", functools.partial(write, group))
        found |= {spec.name: locate(spec, root) for spec in group}
    return {spec.name: found[spec.name] for spec in specs}


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory) -> dict[str, Fixture]:
    """Every fixture checkpoint, written once per run by real torch FSDP on gloo."""
    specs = [*FIXTURE_SPECS, *LORA_FIXTURE_SPECS, REMOTE_CODE_SPEC, WIDE_SPEC]
    return written_by_world_size(tmp_path_factory, "fixtures", specs, write_fixtures, fixture_at)


STACKED_EXPERTS_SPEC = FixtureSpec("qwen3moe-stacked-halves-ws2", model="qwen3_moe", world_size=2, tie=False)
"""Experts stacked one projection per tensor, as VeOmni's models hold them under transformers 4."""


@pytest.fixture(scope="session")
def stacked_experts_fixture(tmp_path_factory) -> Fixture:
    """The stacked-experts checkpoint, written once per run by real torch FSDP2 (`tests.writers.stacked_experts_worker`)."""
    write = functools.partial(
        write_fixtures, [STACKED_EXPERTS_SPEC], worker="tests.writers.stacked_experts_worker", import_root=REPO
    )
    return fixture_at(STACKED_EXPERTS_SPEC, written_once(tmp_path_factory, "stacked-experts", write))


EIGHT_RANK_SPEC = FixtureSpec("qwen2-ws8", world_size=8)
"""A checkpoint of one verl node of eight GPUs, for the scale-out tests."""


@pytest.fixture(scope="session")
def eight_rank_fixture(tmp_path_factory) -> Fixture:
    """The eight-rank checkpoint, written once per run by real torch FSDP2 on gloo."""
    write = functools.partial(write_fixtures, [EIGHT_RANK_SPEC])
    return fixture_at(EIGHT_RANK_SPEC, written_once(tmp_path_factory, "eight-ranks", write))


VEOMNI_FIXTURE_SPECS = [
    VeomniFixtureSpec("veomni-qwen3moe-ep2-ws2"),
    VeomniFixtureSpec("veomni-qwen3moe-ep2-sp2-ws4", world_size=4, ulysses=2),
    VeomniFixtureSpec("veomni-qwen3moe-hsdp-ep2-ws4", world_size=4, replicas=2),
]
VEOMNI_HF_MODEL_SPEC = VeomniFixtureSpec("veomni-qwen3moe-hf-model-ws2", expert_parallel=1, save_contents=("hf_model",))
"""verl's FSDP checkpoint manager saving the Hugging Face model alone (`save_contents: [hf_model]`)."""


@pytest.fixture(scope="session")
def veomni_python(request) -> Path:
    """Python of a venv holding VeOmni and verl (`tests.side_venvs`)."""
    return side_venvs.python_of(side_venvs.VEOMNI, request)


@pytest.fixture(scope="session")
def veomni_fixtures(tmp_path_factory, veomni_python) -> dict[str, VeomniFixture]:
    """Every VeOmni fixture checkpoint, written once per run by VeOmni and verl's checkpoint manager on gloo."""
    write = functools.partial(write_veomni_fixtures, python=veomni_python)
    specs = [*VEOMNI_FIXTURE_SPECS, VEOMNI_HF_MODEL_SPEC]
    return written_by_world_size(tmp_path_factory, "veomni-fixtures", specs, write, veomni_fixture_at)


TORCHTITAN_FIXTURE_SPECS = [
    TorchTitanFixtureSpec("torchtitan-qwen3-tied-ws2"),
    TorchTitanFixtureSpec("torchtitan-qwen3moe-ws2", model="qwen3_moe", tie=False),
    TorchTitanFixtureSpec("torchtitan-llama-ws2", model="llama", tie=False),
]


@pytest.fixture(scope="session")
def torchtitan_python(request) -> Path:
    """Python of a venv holding torchtitan (`tests.side_venvs`)."""
    return side_venvs.python_of(side_venvs.TORCHTITAN, request)


@pytest.fixture(scope="session")
def torchtitan_fixtures(tmp_path_factory, torchtitan_python) -> dict[str, TorchTitanFixture]:
    """Every TorchTitan fixture checkpoint, written once per run by torchtitan's checkpoint manager on gloo."""
    write = functools.partial(write_torchtitan_fixtures, python=torchtitan_python)
    return written_by_world_size(
        tmp_path_factory, "torchtitan-fixtures", TORCHTITAN_FIXTURE_SPECS, write, torchtitan_fixture_at
    )


AUTOMODEL_SPEC = AutomodelFixtureSpec("automodel-qwen3-ws2")


@pytest.fixture(scope="session")
def automodel_python(request) -> Path:
    """Python of a venv holding nemo-automodel (`tests.side_venvs`)."""
    return side_venvs.python_of(side_venvs.AUTOMODEL, request)


@pytest.fixture(scope="session")
def automodel_fixture(tmp_path_factory, automodel_python) -> AutomodelFixture:
    """The Automodel fixture checkpoint, written once per run by nemo-automodel's checkpointer on gloo."""
    write = functools.partial(write_automodel_fixtures, [AUTOMODEL_SPEC], python=automodel_python)
    return automodel_fixture_at(AUTOMODEL_SPEC, written_once(tmp_path_factory, "automodel-fixtures", write))


MEGATRON_FIXTURE_SPECS = [
    MegatronFixtureSpec("megatron-qwen2-tp1"),
    MegatronFixtureSpec("megatron-llama-tied-tp2", model="llama", tp=2, tie=True),
    MegatronFixtureSpec("megatron-qwen3-pp2-2025-layout", model="qwen3", pp=2, layout="2025"),
    MegatronFixtureSpec("megatron-qwen2-tied-tp2-pp2", tp=2, pp=2, tie=True),
    MegatronFixtureSpec("megatron-qwen2moe-ep2", model="qwen2_moe", ep=2),
    MegatronFixtureSpec("megatron-qwen3moe-tp2", model="qwen3_moe", tp=2),
    MegatronFixtureSpec("megatron-mixtral-ep2-singleton-shards", model="mixtral", ep=2, singleton_shards=True),
    MegatronFixtureSpec("megatron-deepseek-v3-mla-mtp-tp2-ep2", model="deepseek_v3", tp=2, ep=2, mtp=1),
    MegatronFixtureSpec("megatron-glm4moe-tp2-ep2-mtp", model="glm4_moe", tp=2, ep=2, mtp=1),
    MegatronFixtureSpec("megatron-gptoss-tp2-ep2", model="gpt_oss", tp=2, ep=2),
    MegatronFixtureSpec("megatron-gptoss-ep2-singleton-shards", model="gpt_oss", ep=2, singleton_shards=True),
    MegatronFixtureSpec("megatron-qwen25vl-tp1", model="qwen2_5_vl"),  # mbridge's model, filled by its own loader
    MegatronFixtureSpec("megatron-qwen25vl-tp2", model="qwen2_5_vl", tp=2),
    MegatronFixtureSpec("megatron-qwen25vl-tp4", model="qwen2_5_vl", tp=4),
    MegatronFixtureSpec("megatron-qwen3vl-tp2", model="qwen3_vl", tp=2),  # Megatron-Bridge's layout, from its source
    MegatronFixtureSpec("megatron-qwen3vlmoe-tp2-ep2", model="qwen3_vl_moe", tp=2, ep=2),
    MegatronFixtureSpec("megatron-qwen35-tp2", model="qwen3_5", tp=2),  # megatron-core's gated delta net
    MegatronFixtureSpec("megatron-qwen35moe-tp2-ep2-mtp", model="qwen3_5_moe", tp=2, ep=2, mtp=1),
    MegatronFixtureSpec("megatron-qwen3next-tp2-ep2-mtp", model="qwen3_next", tp=2, ep=2, mtp=1),
]
MEGATRON_FIXTURE_NAMES = [spec.name for spec in MEGATRON_FIXTURE_SPECS]


@pytest.fixture(scope="session")
def megatron_fixtures(tmp_path_factory) -> dict[str, MegatronFixture]:
    """Every Megatron fixture checkpoint, written once per run by real megatron-core on gloo."""
    return written_by_world_size(
        tmp_path_factory, "megatron-fixtures", MEGATRON_FIXTURE_SPECS, write_megatron_fixtures, megatron_fixture_at
    )


@pytest.fixture
def copy_checkpoint(fixtures, tmp_path) -> Callable[[str], Fixture]:
    """A private copy of a fixture's run directory, for tests that damage it."""

    def copy(name: str) -> Fixture:
        fixture = fixtures[name]
        run_dir = tmp_path / name / "run"
        shutil.copytree(fixture.run_dir, run_dir)
        checkpoint_dir = run_dir / fixture.checkpoint_dir.relative_to(fixture.run_dir)
        return Fixture(fixture.spec, fixture.reference_dir, run_dir, checkpoint_dir)

    return copy


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real, temporary Prefect server (and database) for the session; results go to a temp dir. The server
    is the configured one (`PREFECT_API_URL`) from then on, for `mergeflow` commands run here and in
    subprocesses alike, as it would be for a user who keeps one up."""
    from prefect.settings import (
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH,
        get_current_settings,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    storage = tmp_path_factory.mktemp("prefect-results")
    with (
        temporary_settings(
            {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None, PREFECT_RESULTS_LOCAL_STORAGE_PATH: storage}
        ),
        prefect_test_harness(server_startup_timeout=180),
        pytest.MonkeyPatch.context() as environment,
    ):
        environment.setenv("PREFECT_API_URL", str(get_current_settings().api.url))
        environment.setenv("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(storage))
        yield


@pytest.fixture
def target_dir(tmp_path) -> Path:
    return tmp_path / "merged"
