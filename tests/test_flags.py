"""Flags are taken only as spelled: no prefix of a flag stands for it, and every mistake with flags is one
line naming the flag or value (with the closest valid flag), at most one hint, and exit 2."""

import pytest

from mergeflow.cli import EXIT_BAD_INPUT, build_parser
from mergeflow.version import __version__
from tests.cli_runs import run_cli


def commands() -> dict:
    return next(action for action in build_parser()._actions if action.dest == "command").choices


def strict_prefixes_of_flags() -> list[tuple[str, str]]:
    """(command, prefix) for every prefix (`--x` and longer) of every long flag that is not itself a flag."""
    cases = set()
    for name, command in commands().items():
        flags = set(command._option_string_actions)
        for flag in flags:
            if flag.startswith("--"):
                cases |= {(name, flag[:end]) for end in range(3, len(flag)) if flag[:end] not in flags}
    return sorted(cases)


def assert_one_line_error(run, message: str) -> None:
    assert run.returncode == EXIT_BAD_INPUT, run.stderr
    assert run.error_lines[0].startswith("mergeflow: error: ") and message in run.error_lines[0], run.stderr
    assert len(run.error_lines) <= 2 and all(line.startswith("mergeflow: hint: ") for line in run.error_lines[1:])
    assert run.stdout == ""


def test_no_prefix_of_any_flag_of_any_command_is_accepted(capsys):
    refused = []
    for command, prefix in strict_prefixes_of_flags():
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args([command, prefix, "x"])
        refused.append(exit_info.value.code == EXIT_BAD_INPUT and f"unknown flag {prefix}" in capsys.readouterr().err)

    assert len(refused) > 100 and all(refused)


def test_an_abbreviated_overwrite_deletes_nothing(fixtures, tmp_path):
    target = tmp_path / "o"
    target.mkdir()
    (target / "keep.txt").write_text("mine")

    run = run_cli("merge", "--local_dir", fixtures["qwen2-ws2"].checkpoint_dir, "--target_dir", target, "--o")

    assert_one_line_error(run, "unknown flag --o")
    assert (target / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["merge", "--local-dri", "X"], "unknown flag --local-dri: did you mean --local-dir?"),
        (["merge", "--local_dir", "X", "--dtpye", "bf16"], "unknown flag --dtpye: did you mean --dtype?"),
        (["merge", "--local_dir", "X", "--target-dri", "Y"], "unknown flag --target-dri: did you mean --target-dir?"),
        (["merge", "--local_dir", "X", "--over"], "unknown flag --over: did you mean --overwrite?"),
        (["merge", "--local_dir", "X", "--dtyp=bf16"], "unknown flag --dtyp: did you mean --dtype?"),
        (["--dry-run", "merge"], "unknown flag --dry-run"),
    ],
)
def test_a_mistyped_flag_is_named_with_the_closest_valid_one(argv, message):
    assert_one_line_error(run_cli(*argv), message)


def test_a_value_not_among_the_choices_is_one_line_listing_them():
    run = run_cli("merge", "--local_dir", "X", "--dtype", "bfloat16")

    assert_one_line_error(run, "argument --dtype: invalid choice: 'bfloat16' (choose from 'bf16', 'fp16', 'fp32', 'keep')")


def test_a_missing_required_flag_is_one_line_naming_it():
    assert_one_line_error(run_cli("merge"), "the following arguments are required: --local_dir")


def test_version_prints_the_package_version():
    run = run_cli("--version")

    assert (run.returncode, run.stdout.strip()) == (0, f"mergeflow {__version__}")


@pytest.mark.parametrize("name", sorted(commands()))
def test_each_command_help_has_a_one_line_description_and_an_example(name):
    help_text = commands()[name].format_help()

    assert commands()[name].description.split("\n")[0].endswith(".")
    assert f"example:\n  mergeflow {name}" in help_text


def test_the_top_level_help_speaks_to_users_not_of_internals():
    assert "mergeflow.preflight" not in build_parser().format_help()


def test_watch_help_says_it_needs_a_server_and_serve_help_that_watch_repeats():
    assert "Needs a Prefect server that stays up" in commands()["watch"].format_help()
    assert "repeat --watch" in commands()["serve"].format_help()
