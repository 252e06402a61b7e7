"""The `mergeflow` command: verl's `model_merger` flags, run as Prefect flows.

Mistakes the paths and flags show are answered before Prefect or torch is imported (`mergeflow.preflight`),
in one line; errors found later, inside a flow, reach the console once (the run's logs in Prefect keep
the whole story), and a merge's last line is its verdict.
"""

import argparse
import contextlib
import difflib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from mergeflow import preflight
from mergeflow.errors import MergeflowError, OptionError, UploadError, ValidationError
from mergeflow.formats.registry import BACKEND_NAMES, BACKENDS
from mergeflow.log_handlers import every_log_handler
from mergeflow.options import (
    DEFAULT_BACKEND,
    DEFAULT_DTYPE,
    DEFAULT_TARGET_DIR,
    DTYPE_NAMES,
    MAX_SHARD_SIZE,
    QUANTIZE_CHOICES,
    HubUpload,
    MergeOptions,
    Reference,
    check_repo_id,
)
from mergeflow.perf import timeline
from mergeflow.perf.collector import paused_for_imports
from mergeflow.perf.fast_exit import exit_now
from mergeflow.sizes import human_size
from mergeflow.version import __version__

if TYPE_CHECKING:
    from uuid import UUID

    from mergeflow.deployments.server import TemporaryServer

PREFECT_DEFAULTS = {  # no telemetry; a first start of the ephemeral server migrates its database slowly
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}
EXIT_VALIDATION_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_UPLOAD_FAILED = 3
EXIT_INTERRUPTED = 130
STOP_DRAIN_SECONDS = 0.5
"""How long a stopping `serve` or `watch` waits to send its queued logs and events (its server may be gone)."""


DESCRIPTION = """Merge verl's distributed checkpoints (FSDP rank files, Megatron torch_dist archives) into Hugging
Face model folders, as Prefect flows you can watch in the Prefect UI."""


class CommandParser(argparse.ArgumentParser):
    """argparse without prefix matching (`--o` is an error, never `--overwrite`), whose mistakes are one line
    naming the flag or value, with the closest valid flag, and exit 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        self._refuse_unknown_flags(args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        print(f"mergeflow: error: {message}", file=sys.stderr)
        print(f"mergeflow: hint: `{self.prog} --help` lists the flags", file=sys.stderr)
        self.exit(EXIT_BAD_INPUT)

    def _refuse_unknown_flags(self, args: list[str]) -> None:
        """Name the first `--flag` this parser does not know, before argparse asks for required arguments;
        a parser with subcommands checks only the flags before the subcommand (which checks its own)."""
        for token in args:
            if token == "--" or (self._subparsers is not None and not token.startswith("-")):
                return
            flag = token.split("=", 1)[0]
            if flag.startswith("--") and flag not in self._option_string_actions:
                self.error(unknown_flag_message(flag, self._option_string_actions))


def unknown_flag_message(flag: str, known: "Iterable[str]") -> str:
    closest = difflib.get_close_matches(flag, [name for name in known if name.startswith("--")], n=1, cutoff=0.6)
    return f"unknown flag {flag}" + (f": did you mean {closest[0]}?" if closest else "")


@dataclass(frozen=True)
class Flag:
    """One command-line option, defined once and added to every subcommand that has it."""

    names: tuple[str, ...]
    settings: dict

    def add(self, parser: argparse.ArgumentParser, **overrides) -> None:
        parser.add_argument(*self.names, **{**self.settings, **overrides})


def _flag(*names: str, **settings) -> Flag:
    return Flag(names, settings)


FLAGS = {
    "backend": _flag(
        "--backend", choices=BACKEND_NAMES, default=DEFAULT_BACKEND,
        help="checkpoint format: " + "; ".join(f"{backend.name}: {backend.description}" for backend in BACKENDS),
    ),
    "local_dir": _flag(
        "--local_dir", "--local-dir", dest="local_dir", required=True, help="the checkpoint: .../global_step_N/actor (or critic)"
    ),
    "hf_model_config_path": _flag(
        "--hf_model_config_path", "--hf-model-config-path", "--hf_model_path", "--hf-model-path", dest="hf_model_config_path",
        default=None, help="directory with config.json and tokenizer (default: LOCAL_DIR/huggingface)",
    ),
    "trust_remote_code": _flag(
        "--trust-remote-code", "--trust_remote_code", dest="trust_remote_code", action="store_true",
        help="allow a config whose model is custom code (auto_map); it is refused otherwise",
    ),
    "tie_word_embedding": _flag(
        "--tie-word-embedding", "--tie_word_embedding", dest="tie_word_embedding", action="store_true",
        help="accepted for verl compatibility; the config decides ties",
    ),
    "is_value_model": _flag(
        "--is-value-model", "--is_value_model", dest="is_value_model", action="store_true",
        help="merge a critic saved with a causal-LM config as *ForTokenClassification",
    ),
    "use_cpu_initialization": _flag(
        "--use_cpu_initialization", "--use-cpu-initialization", dest="use_cpu_initialization", action="store_true",
        help="accepted for verl compatibility; mergeflow always runs on CPU",
    ),
    "merge_lora": _flag(
        "--merge-lora", "--merge_lora", dest="merge_lora", action="store_true",
        help="fold LoRA into the base weights (default: base model plus lora_adapter/)",
    ),
    "lora_alpha": _flag(
        "--lora-alpha", "--lora_alpha", dest="lora_alpha", type=float, default=None,
        help="LoRA alpha, when the checkpoint has no lora_train_meta.json or lora_adapter/ config",
    ),
    "target_dir": _flag(
        "--target_dir", "--target-dir", dest="target_dir", default=DEFAULT_TARGET_DIR,
        help=f"output folder (default: ./{DEFAULT_TARGET_DIR}, as verl); refused when not empty unless --overwrite",
    ),
    "dtype": _flag(
        "--dtype", choices=DTYPE_NAMES, default=DEFAULT_DTYPE, help="dtype of floating tensors in the output (default: bf16, as verl)"
    ),
    "max_shard_size": _flag(
        "--max-shard-size", "--max_shard_size", dest="max_shard_size", default=MAX_SHARD_SIZE,
        help=f"largest safetensors file (default {MAX_SHARD_SIZE}); larger models get an index",
    ),
    "overwrite": _flag(
        "--overwrite", action="store_true",
        help="replace a non-empty target (an earlier merge's output or an ordinary folder, never training files)",
    ),
    "quantize": _flag(
        "--quantize", choices=QUANTIZE_CHOICES, default=None,
        help="store the linear layers' weights in FP8 with 128x128 block scales, as vLLM and SGLang load them",
    ),
    "drop_mtp": _flag(
        "--drop-mtp", "--drop_mtp", dest="drop_mtp", action="store_true",
        help="leave out multi-token-prediction layers (kept by default, for vLLM's MTP speculative decoding)",
    ),
    "progress": _flag(
        "--no-progress", dest="progress", action="store_false", help="no progress bars (they are shown only on a terminal)"
    ),
    "refresh_cache": _flag(
        "--no-cache", dest="refresh_cache", action="store_true", help="merge again even when the same merge's output is in place"
    ),
    "task_runner": _flag(
        "--task-runner", "--task_runner", dest="task_runner", default="threads",
        help="where weight files are written (or, for test, compared): threads[:N] (default), dask[:N] (a local cluster), dask://HOST:PORT, "
        "ray (a local Ray, or RAY_ADDRESS's cluster), ray:HOST:PORT or ray://HOST:PORT (a running Ray cluster)",
    ),
    "test_hf_dir": _flag(
        "--test_hf_dir", "--test-hf-dir", dest="test_hf_dir", default=None, help="also compare the merged model with this reference model"
    ),
    "check_logits": _flag(
        "--check-logits", "--check_logits", dest="check_logits", action="store_true",
        help="with --test_hf_dir: also compare logits (on CPU, when both models fit in RAM)",
    ),
    "atol": _flag("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bit for bit)"),
    "rtol": _flag("--rtol", type=float, default=0.0, help="relative tolerance (default 0: bit for bit)"),
    "hf_upload_path": _flag(
        "--hf_upload_path", "--hf-upload-path", "--upload", dest="hf_upload_path", default=None, metavar="USER/NAME",
        help="upload each validated model to this Hub repo; HF_ENDPOINT selects a mirror",
    ),
    "private": _flag("--private", action="store_true", help="create the Hub repo as private"),
    "revision": _flag("--revision", default=None, help="Hub branch to upload to (default: step-N, from global_step_N)"),
    "hf_token_secret": _flag(
        "--hf-token-secret", "--hf_token_secret", dest="hf_token_secret", default=None,
        help="name of a Prefect Secret block holding the Hub token (default: HF_TOKEN or the hf login)",
    ),
    "base_model": _flag("--base-model", "--base_model", dest="base_model", default=None, help="base model id for the model card"),
    "output_dir": _flag(
        "--output", dest="output_dir", required=True, help="merged models go to OUTPUT/<run>/global_step_N/<role>"
    ),
}  # fmt: skip
"""Every option of every subcommand, by the attribute it sets."""

CHECKPOINT_FLAGS = (
    "backend", "local_dir", "hf_model_config_path", "trust_remote_code", "tie_word_embedding", "is_value_model",
    "use_cpu_initialization", "merge_lora", "lora_alpha",
)  # fmt: skip
"""The flags of verl's `python -m verl.model_merger`, in its spellings and in dash/underscore forms."""
UPLOAD_FLAGS = ("hf_upload_path", "private", "hf_token_secret")
AUTOMATION_FLAGS = ("output_dir", "dtype", "quantize", "drop_mtp", *UPLOAD_FLAGS)
"""The options of merges nobody types by hand (serve, sweep): where models go, their dtype, and the upload."""
COMMAND_FLAGS = {
    "merge": (
        *CHECKPOINT_FLAGS, "target_dir", "dtype", "max_shard_size", "overwrite", "quantize", "drop_mtp", "progress",
        "refresh_cache", "task_runner", "test_hf_dir", *UPLOAD_FLAGS, "revision", "base_model", "check_logits",
    ),
    "test": (*CHECKPOINT_FLAGS, "test_hf_dir", "dtype", "atol", "rtol", "task_runner"),
    "validate": ("test_hf_dir", "check_logits", "atol", "rtol"),
    "inspect": ("backend", "hf_model_config_path", "trust_remote_code"),
    "serve": (*AUTOMATION_FLAGS, "task_runner"),
    "sweep": (*AUTOMATION_FLAGS, "task_runner"),
}  # fmt: skip
"""Which of `FLAGS` each subcommand has (besides its positional arguments and its own flags)."""
FLAG_OVERRIDES = {
    ("test", "test_hf_dir"): {"required": True, "help": "the reference model folder"},
    ("test", "dtype"): {"default": None, "help": "dtype the merged tensors are compared in (default: the reference's)"},
    ("validate", "test_hf_dir"): {"help": "a reference model to compare with, cast to the merged model's dtype"},
}
"""Where a subcommand gives a shared flag another default or meaning."""


def _add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    for name in COMMAND_FLAGS[command]:
        FLAGS[name].add(parser, **FLAG_OVERRIDES.get((command, name), {}))


RUN_DIR_HELP = "a verl run directory (holding global_step_N/)"

EXAMPLES = {
    "merge": "mergeflow merge --backend fsdp --local_dir ckpts/run-a/global_step_100/actor --target_dir models/step-100",
    "test": "mergeflow test --local_dir ckpts/run-a/global_step_100/actor --test_hf_dir models/original",
    "validate": "mergeflow validate models/step-100 --test_hf_dir models/original",
    "inspect": "mergeflow inspect ckpts/run-a/global_step_100/actor",
    "watch": "mergeflow watch ckpts/run-a ckpts/run-b",
    "serve": "mergeflow serve --watch ckpts/run-a --watch ckpts/run-b --output models",
    "sweep": "mergeflow sweep ckpts/run-a --output models",
    "server": "mergeflow server --port 4200   (stop it with Ctrl-C or `kill PID`)",
    "demo": "mergeflow demo --workdir mergeflow-demo",
}
"""One example per subcommand, shown at the end of its --help."""


def _command(commands, name: str, summary: str, details: str = "") -> argparse.ArgumentParser:
    """A subcommand whose --help starts with its one-line summary and ends with an example."""
    description = summary[0].upper() + summary[1:] + "." + (f"\n\n{details}" if details else "")
    return commands.add_parser(name, help=summary, description=description, epilog=f"example:\n  {EXAMPLES[name]}")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="mergeflow", description=DESCRIPTION, epilog="`mergeflow COMMAND --help` shows a command's flags and an example.")
    parser.add_argument("--version", action="version", version=f"mergeflow {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    merge = _command(commands, "merge", "merge a checkpoint into a Hugging Face model folder")
    _add_flags(merge, "merge")

    test = _command(commands, "test", "compare a checkpoint's merged tensors with a reference model (nothing is written)")
    _add_flags(test, "test")

    validate = _command(commands, "validate", "check a merged model folder, optionally against a reference")
    validate.add_argument("target_dir", help="the merged model folder")
    _add_flags(validate, "validate")

    inspect = _command(commands, "inspect", "describe a checkpoint without merging it")
    inspect.add_argument("local_dir", help="the checkpoint: .../global_step_N/actor (or critic)")
    _add_flags(inspect, "inspect")
    inspect.add_argument("--json", action="store_true", help="print JSON")

    watch = _command(
        commands,
        "watch",
        "announce each complete checkpoint of verl runs as a Prefect event",
        "Needs a Prefect server that stays up (`mergeflow server`, or PREFECT_API_URL): deployments triggered by\n"
        "the events run there. `mergeflow serve` watches and merges in one command.",
    )
    watch.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help=RUN_DIR_HELP)

    serve = _command(
        commands,
        "serve",
        "merge each checkpoint of verl runs as it is saved, and sweep on a schedule",
        "Serves the merge-on-checkpoint and sweep deployments with a watcher per run directory. Needs a Prefect\n"
        "server that stays up (`mergeflow server`, or PREFECT_API_URL). Stop it with Ctrl-C or `kill PID`.",
    )
    serve.add_argument(
        "--watch", dest="run_dirs", action="append", required=True, metavar="RUN_DIR",
        help="a verl run directory to watch; repeat --watch for several runs",
    )  # fmt: skip
    _add_flags(serve, "serve")
    serve.add_argument("--schedule", default=None, metavar="CRON", help="cron schedule of the sweep (default: hourly)")
    serve.add_argument("--concurrency", type=int, default=1, help="merges at once (default 1)")

    sweep = _command(commands, "sweep", "merge every complete checkpoint of verl runs not merged yet")
    sweep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help=RUN_DIR_HELP)
    _add_flags(sweep, "sweep")

    server = _command(
        commands,
        "server",
        "keep a Prefect server (and its UI) up on 127.0.0.1; mergeflow commands then use it",
        "It runs until stopped: Ctrl-C, or `kill PID` (SIGTERM, SIGINT and SIGHUP stop it and its Prefect server).",
    )
    server.add_argument("--port", type=int, default=4200, help="its port (default 4200)")

    demo = _command(commands, "demo", "write a tiny real FSDP2 checkpoint and merge it")
    demo.add_argument(
        "--workdir", default=None, help="where to put the demo's checkpoint and merged model (default: a new temporary directory)"
    )
    return parser


def run_merge(args: argparse.Namespace) -> int:
    from mergeflow import write_ahead
    from mergeflow.job import MergeJob

    job = MergeJob(args.local_dir, args.target_dir, MergeOptions.from_values(args))
    from mergeflow.flows.task_runners import writes_in_process

    in_process = writes_in_process(args.task_runner)
    writing_ahead = write_ahead.writing_ahead(job) if in_process else contextlib.nullcontext()
    # not in a caller's process (main called from Python, the tests): what it holds would be frozen for good
    imports = paused_for_imports if args.own_process else contextlib.nullcontext
    with _prefect(allow_temporary=True) as server, writing_ahead:
        if in_process and args.own_process:
            write_ahead.yield_to_spec_build(job)
        # a child reads ahead, builds a new config's spec and writes the weight files while Prefect starts
        with imports():
            from mergeflow.flows.merge import merge_checkpoint
            from mergeflow.flows.task_runners import task_runner_from

        timeline.mark("flow imported")
        flow = merge_checkpoint.with_options(task_runner=task_runner_from(args.task_runner))
        with _prefect_ready(server, while_it_starts=lambda: _import_merge_steps(imports)):
            timeline.mark("server ready")
            state = flow(
                local_dir=args.local_dir,
                target_dir=args.target_dir,
                options=job.options,
                hub=HubUpload.from_values(args),
                reference=Reference.from_values(args),
                overwrite=args.overwrite,
                refresh_cache=args.refresh_cache,
                progress=args.progress,
                return_state=True,
            )
        timeline.mark("flow returned")
        if timeline.enabled():
            _mark_task_runs(state.state_details.flow_run_id)
        saved = state.result()
    timeline.mark("command done")
    files = f"{len(saved.weight_files)} weight file{'s' if len(saved.weight_files) != 1 else ''}"
    facts = f"{saved.num_tensors} tensors, {saved.dtype}, {human_size(saved.total_size)} in {files}; validation {saved.validation}"
    if saved.up_to_date:
        return _verdict(f"{saved.folder} is up to date: it holds this merge of {args.local_dir}, nothing was written ({facts})")
    return _verdict(f"merged {args.local_dir} into {saved.folder}: {facts}")


def run_test(args: argparse.Namespace) -> int:
    with _prefect(allow_temporary=True) as server:
        from mergeflow.flows.task_runners import task_runner_from
        from mergeflow.flows.verify import verify_checkpoint

        with _prefect_ready(server):
            report = verify_checkpoint.with_options(task_runner=task_runner_from(args.task_runner))(
                local_dir=args.local_dir,
                reference=Reference.from_values(args),
                options=MergeOptions.from_values(args),
                in_reference_dtype=args.dtype is None,
            )
    return _verdict(f"{args.local_dir}: {report.tensors_compared} tensors equal {args.test_hf_dir}")


def run_validate(args: argparse.Namespace) -> int:
    with _prefect(allow_temporary=True) as server:
        from mergeflow.flows.validate import validate_model

        with _prefect_ready(server):
            report = validate_model(target_dir=args.target_dir, reference=Reference.from_values(args))
    return _verdict(f"{args.target_dir}: validation {report.verdict()}")


def run_inspect(args: argparse.Namespace) -> int:
    from mergeflow.describe import describe_checkpoint, format_description

    description = describe_checkpoint(
        Path(args.local_dir),
        backend=args.backend,
        hf_model_config_path=args.hf_model_config_path,
        trust_remote_code=args.trust_remote_code,
    )
    print(json.dumps(description, indent=2) if args.json else format_description(description))
    return 0


def run_demo(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="mergeflow-demo-"))
    with _prefect(allow_temporary=True) as server:
        from mergeflow.flows.demo import run_demo as demo

        with _prefect_ready(server):
            matches = demo(workdir)
    return _verdict(
        f"demo files are in {workdir.absolute()} (the checkpoint under demo/, the merged model in merged/); "
        f"logits of the merged model equal the original's (bf16): {matches}",
        code=0 if matches else 1,
    )


def run_watch(args: argparse.Namespace) -> int:
    import time

    with _prefect(allow_temporary=False):
        from mergeflow.deployments.watcher import watching

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        with watching(args.run_dirs):
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                return 0


def run_serve(args: argparse.Namespace) -> int:
    with _prefect(allow_temporary=False):
        from mergeflow.deployments.serve import ServeOptions, serve_forever

        serve_forever(
            ServeOptions(
                run_dirs=[str(Path(d).absolute()) for d in args.run_dirs],
                output_dir=str(Path(args.output_dir).absolute()),
                options=MergeOptions.from_values(args),
                hub=HubUpload.from_values(args),
                schedule=args.schedule,
                concurrency=args.concurrency,
                task_runner=args.task_runner,
            ),
            say=_say,
        )
    return 0


def _say(line: str) -> None:
    """A line for the console of a long-running command, at once."""
    print(f"mergeflow: {line}", flush=True)


def run_sweep(args: argparse.Namespace) -> int:
    with _prefect(allow_temporary=True) as server:
        from mergeflow.flows.sweep import sweep_checkpoints

        with _prefect_ready(server):
            merged = sweep_checkpoints(
                run_dirs=[str(Path(d).absolute()) for d in args.run_dirs],
                output_dir=str(Path(args.output_dir).absolute()),
                options=MergeOptions.from_values(args),
                hub=HubUpload.from_values(args),
                task_runner=args.task_runner,
            )
    return _verdict(f"merged {len(merged)} checkpoint(s)" + "".join(f"\n  {target}" for target in merged))


def run_server(args: argparse.Namespace) -> int:
    from mergeflow.deployments.server import keep_server_up

    return keep_server_up(args.port)


COMMANDS = {
    "merge": run_merge,
    "test": run_test,
    "validate": run_validate,
    "inspect": run_inspect,
    "demo": run_demo,
    "watch": run_watch,
    "serve": run_serve,
    "sweep": run_sweep,
    "server": run_server,
}


@contextlib.contextmanager
def _prefect(*, allow_temporary: bool):
    """The Prefect server of a command (`deployments.server.prefect_api`); with its queued logs and events
    sent before a temporary one stops. Serving and watching need a server that outlives the command.

    Raises:
        OptionError: no server runs, and the command needs one that stays up.
    """
    from mergeflow.deployments.server import (
        API_URL_VARIABLE,
        configured_api_url,
        kept_up_api_url,
        prefect_api,
    )

    if not allow_temporary and not (configured_api_url() or kept_up_api_url()):
        raise OptionError(
            "this command needs a Prefect server that stays up (schedules and event triggers run there)",
            hint=f"start one with `mergeflow server` in another terminal, or set {API_URL_VARIABLE}",
        )
    with prefect_api() as server:
        try:
            yield server
        finally:
            _send_prefect_queues(timeout=None if allow_temporary else STOP_DRAIN_SECONDS)


def _send_prefect_queues(timeout: float | None = None) -> None:
    """Send the Prefect logs and events still queued in this process (before its server may stop), waiting at most
    `timeout` seconds for each queue (a server that went away would be retried for minutes)."""
    if "prefect.logging.handlers" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=timeout)
    EventsWorker.drain_all(timeout=timeout)


def check_arguments(args: argparse.Namespace) -> None:
    """What the command's paths and flags show, checked before anything heavy is imported.

    Raises:
        MergeflowError: the first mistake found.
    """
    from mergeflow.flows.task_runners import check_task_runner

    if args.command == "merge":
        preflight.check_merge(
            args.local_dir,
            args.target_dir,
            backend=args.backend,
            hf_model_config_path=args.hf_model_config_path,
            overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
            test_hf_dir=args.test_hf_dir,
            hf_upload_path=args.hf_upload_path,
        )
    elif args.command == "test":
        preflight.check_checkpoint(args.local_dir, args.backend, args.hf_model_config_path)
        preflight.check_reference(args.test_hf_dir)
    elif args.command == "validate":
        preflight.check_model_folder(args.target_dir)
        if args.test_hf_dir:
            preflight.check_reference(args.test_hf_dir)
    elif args.command == "inspect":
        preflight.check_checkpoint(args.local_dir, args.backend, args.hf_model_config_path)
    elif args.command in ("watch", "serve", "sweep"):
        preflight.check_run_dirs(args.run_dirs)
    if args.command in ("serve", "sweep"):
        preflight.check_output_dir(args.output_dir, args.run_dirs)
        if args.hf_upload_path:
            check_repo_id(args.hf_upload_path)
    if getattr(args, "task_runner", None):
        check_task_runner(args.task_runner)


QUIET_PREFIXES = ("Finished in state Failed(", "Still processing items")


class _EchoFilter(logging.Filter):
    """Keeps Prefect's console output to one mention of each failure: a mergeflow error (bad input, a failed
    validation) is left to the CLI's one line, another exception is shown once with its traceback, and the
    "Finished in state Failed(...)" lines that repeat it are dropped, as are the "Still processing items"
    lines of Prefect's log and event queues while the command sends what they hold before it ends. The run's
    logs in the Prefect API keep every record."""

    def __init__(self, *, temporary_server: bool):
        super().__init__()
        self._shown: set[int] = set()
        self._dead_links = temporary_server
        """A temporary server has no UI: the "View at" links Prefect prints would lead nowhere."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        if message.startswith(QUIET_PREFIXES) or (self._dead_links and message.startswith("View at ")):
            return False
        error = record.exc_info[1] if record.exc_info else None
        if error is None:
            return True
        if isinstance(error, MergeflowError) or id(error) in self._shown:
            return False
        self._shown.add(id(error))
        return True


@contextlib.contextmanager
def _prefect_ready(
    server: "TemporaryServer | None", *, while_it_starts: Callable[[], None] | None = None
) -> Iterator[None]:
    """Once the flow is imported, for the flow runs of a command that runs them and ends: `_EchoFilter` on
    Prefect's console handlers, the temporary server (if any) waited for (calling `while_it_starts` first if it
    does not answer yet), and no flow run heartbeats unless their frequency is set. Heartbeats let a server
    notice a run whose process died; their thread, which sleeps a second at a time, holds up the end of every
    flow run by up to a second."""
    from prefect.logging import configuration
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings, temporary_settings

    if not configuration.PROCESS_LOGGING_CONFIG:  # importing Prefect's flows configured it already
        configuration.setup_logging()
    echo_filter = _EchoFilter(temporary_server=server is not None)
    for handler in every_log_handler():
        if type(handler).__name__ == "PrefectConsoleHandler":
            handler.addFilter(echo_filter)
    if server is not None:
        if while_it_starts is not None and not server.answers():
            while_it_starts()
        server.wait()
    heartbeats_set = "heartbeat_frequency" in get_current_settings().flows.model_fields_set
    with contextlib.nullcontext() if heartbeats_set else temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def _import_merge_steps(imports: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Import (in the `imports` context) what the merge flow's first steps need (torch and the engine), and the
    encoder Prefect serializes a flow run's parameters with: while a temporary server starts, rather than after."""
    with imports():
        import fastapi.encoders  # noqa: F401

        import mergeflow.output.save
        import mergeflow.spec.model_spec  # noqa: F401

    timeline.mark("merge steps imported")


def _mark_task_runs(flow_run_id: "UUID", settle_seconds: float = 1.0, timeout: float = 15.0) -> None:
    """Put each task run of the flow run on the timeline, with the start and end its server recorded (the server
    records task runs from events, after the flow returns: read until every one has ended and no more come)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    _send_prefect_queues()
    deadline, previous, settled_at = time.monotonic() + timeout, None, time.monotonic()
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            ends = sorted(str(task_run.end_time) for task_run in task_runs)
            if ends != previous:
                previous, settled_at = ends, time.monotonic()
            elif time.monotonic() - settled_at >= settle_seconds and all(task_run.end_time for task_run in task_runs):
                break
            time.sleep(0.1)
    for task_run in task_runs:
        if task_run.start_time is not None:
            timeline.mark(f"task {task_run.name} started", at=task_run.start_time.timestamp(), task=True)
        if task_run.end_time is not None:
            timeline.mark(f"task {task_run.name} ended", at=task_run.end_time.timestamp(), task=True)


def _verdict(line: str, code: int = 0) -> int:
    """Print the command's last line (what happened, where), once Prefect has nothing more to say."""
    print(f"mergeflow: {line}")
    return code


def _report(error: MergeflowError) -> None:
    print(f"mergeflow: error: {type(error).__name__}: {error}", file=sys.stderr)
    if error.hint:
        print(f"mergeflow: hint: {error.hint}", file=sys.stderr)


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """Run one command; `own_process`: the command has this process to itself and ends with it (the console script),
    so it may change the process for good (lower its CPU priority, freeze what its imports made out of the garbage
    collector's sight)."""
    timeline.mark("command started", process="mergeflow command")
    for name, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(name, value)
    args = build_parser().parse_args(argv)
    args.own_process = own_process
    try:
        check_arguments(args)
    except MergeflowError as e:
        _report(e)
        return EXIT_BAD_INPUT
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("mergeflow: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except MergeflowError as e:
        _report(e)
        if isinstance(e, UploadError):
            print(f"mergeflow: the merged model is kept at {args.target_dir}", file=sys.stderr)
            return EXIT_UPLOAD_FAILED
        return EXIT_VALIDATION_FAILED if isinstance(e, ValidationError) else EXIT_BAD_INPUT


def run() -> NoReturn:
    """The `mergeflow` command: `main`, then exit at once (`fast_exit`)."""
    exit_now(main(own_process=True))


if __name__ == "__main__":
    run()
