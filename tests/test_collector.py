"""The garbage collector paused while a process imports: run in child processes, since the pause ends by freezing
what the process holds."""

import subprocess
import sys


def run_python(code: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def test_the_collector_is_paused_in_the_block_and_runs_again_after():
    seen = run_python(
        "import gc\n"
        "from mergeflow.perf.collector import paused_for_imports\n"
        "with paused_for_imports():\n"
        "    print(gc.isenabled())\n"
        "print(gc.isenabled())\n"
    )

    assert seen == ["False", "True"]


def test_what_the_block_made_is_out_of_the_collectors_sight_after_it():
    seen = run_python(
        "import gc\n"
        "from mergeflow.perf.collector import paused_for_imports\n"
        "with paused_for_imports():\n"
        "    import json\n"
        "print(gc.get_freeze_count() > 0)\n"
    )

    assert seen == ["True"]


def test_a_collector_switched_off_before_the_block_stays_off_and_nothing_is_frozen():
    seen = run_python(
        "import gc\n"
        "from mergeflow.perf.collector import paused_for_imports\n"
        "gc.disable()\n"
        "with paused_for_imports():\n"
        "    pass\n"
        "print(gc.isenabled(), gc.get_freeze_count())\n"
    )

    assert seen == ["False", "0"]
