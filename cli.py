"""The `mergeflow` command: verl's `model_merger` flags, run as Prefect flows."""

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

from mergeflow.errors import MergeflowError, UploadError, ValidationError
from mergeflow.planning import DEFAULT_DTYPE, MAX_SHARD_SIZE

PREFECT_DEFAULTS = {  # no telemetry; a first start of the ephemeral server migrates its database slowly
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}
EXIT_VALIDATION_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_UPLOAD_FAILED = 3
DTYPES = ("bf16", "fp16", "fp32", "keep")


def _add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    """The flags of verl's `python -m verl.model_merger`, in its spellings and in dash/underscore forms."""
    parser.add_argument("--backend", choices=["fsdp", "megatron"], default="fsdp")
    parser.add_argument(
        "--local_dir",
        "--local-dir",
        dest="local_dir",
        required=True,
        help="the checkpoint: .../global_step_N/actor (or critic)",
    )
    parser.add_argument(
        "--hf_model_config_path",
        "--hf-model-config-path",
        "--hf_model_path",
        "--hf-model-path",
        dest="hf_model_config_path",
        default=None,
        help="directory with config.json and tokenizer (default: LOCAL_DIR/huggingface)",
    )
    parser.add_argument(
        "--trust-remote-code", "--trust_remote_code", dest="trust_remote_code", action="store_true"
    )
    parser.add_argument(
        "--tie-word-embedding",
        "--tie_word_embedding",
        dest="tie_word_embedding",
        action="store_true",
        help="accepted for verl compatibility; the config decides ties",
    )
    parser.add_argument("--is-value-model", "--is_value_model", dest="is_value_model", action="store_true")
    parser.add_argument(
        "--use_cpu_initialization",
        "--use-cpu-initialization",
        dest="use_cpu_initialization",
        action="store_true",
        help="accepted for verl compatibility; mergeflow always runs on CPU",
    )


def _add_lora_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--merge-lora",
        "--merge_lora",
        dest="merge_lora",
        action="store_true",
        help="fold LoRA into the base weights (default: base model plus lora_adapter/)",
    )
    parser.add_argument(
        "--lora-alpha",
        "--lora_alpha",
        dest="lora_alpha",
        type=float,
        default=None,
        help="LoRA alpha, when the checkpoint has no lora_train_meta.json or lora_adapter/ config",
    )


def _add_tolerance_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bit for bit)")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: bit for bit)")


def _add_task_runner_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--task-runner",
        "--task_runner",
        dest="task_runner",
        default="threads",
        help="where output shards are written: threads[:N] (default), dask[:N] (a local cluster), dask://HOST:PORT",
    )


def _add_automation_options(parser: argparse.ArgumentParser) -> None:
    """Options of merges nobody types by hand: where models go, their dtype, and the upload."""
    parser.add_argument("--output", dest="output_dir", required=True, help="merged models go to OUTPUT/<run>/global_step_N/<role>")
    parser.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE)
    parser.add_argument("--upload", dest="hf_upload_path", default=None, metavar="USER/NAME", help="upload each merged model")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--hf-token-secret", "--hf_token_secret", dest="hf_token_secret", default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mergeflow", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    merge = commands.add_parser("merge", help="merge a checkpoint into a Hugging Face model folder")
    _add_checkpoint_options(merge)
    _add_lora_options(merge)
    merge.add_argument("--target_dir", "--target-dir", dest="target_dir", default="tmp")
    merge.add_argument(
        "--dtype",
        choices=DTYPES,
        default=DEFAULT_DTYPE,
        help="dtype of floating tensors in the output (default: bf16, as verl)",
    )
    merge.add_argument("--max-shard-size", "--max_shard_size", dest="max_shard_size", default=MAX_SHARD_SIZE)
    merge.add_argument("--overwrite", action="store_true", help="replace a non-empty target directory")
    merge.add_argument("--no-progress", dest="progress", action="store_false")
    merge.add_argument(
        "--no-cache",
        dest="refresh_cache",
        action="store_true",
        help="merge again even when the same merge's output is in place",
    )
    _add_task_runner_option(merge)
    merge.add_argument(
        "--test_hf_dir",
        "--test-hf-dir",
        dest="test_hf_dir",
        default=None,
        help="also compare the merged model with this reference model",
    )
    merge.add_argument(
        "--hf_upload_path",
        "--hf-upload-path",
        dest="hf_upload_path",
        default=None,
        help="upload the validated model to this Hub repo (user/name); HF_ENDPOINT selects a mirror",
    )
    merge.add_argument("--private", action="store_true", help="create the Hub repo as private")
    merge.add_argument(
        "--revision", default=None, help="Hub branch to upload to (default: step-N, from global_step_N)"
    )
    merge.add_argument(
        "--hf-token-secret",
        "--hf_token_secret",
        dest="hf_token_secret",
        default=None,
        help="name of a Prefect Secret block holding the Hub token (default: HF_TOKEN or the hf login)",
    )
    merge.add_argument(
        "--base-model", "--base_model", dest="base_model", default=None, help="base model id for the model card"
    )
    merge.add_argument(
        "--check-logits",
        "--check_logits",
        dest="check_logits",
        action="store_true",
        help="with --test_hf_dir: also compare logits (on CPU, when both models fit in RAM)",
    )

    test = commands.add_parser("test", help="compare a checkpoint's merged tensors with a reference model")
    _add_checkpoint_options(test)
    _add_lora_options(test)
    test.add_argument("--test_hf_dir", "--test-hf-dir", dest="test_hf_dir", required=True)
    test.add_argument("--dtype", choices=DTYPES, default=None, help="default: the reference's dtype")
    _add_tolerance_options(test)

    validate = commands.add_parser(
        "validate", help="check a merged model folder, optionally against a reference"
    )
    validate.add_argument("target_dir")
    validate.add_argument("--test_hf_dir", "--test-hf-dir", dest="test_hf_dir", default=None)
    validate.add_argument("--check-logits", "--check_logits", dest="check_logits", action="store_true")
    _add_tolerance_options(validate)

    inspect = commands.add_parser("inspect", help="describe a checkpoint without merging it")
    inspect.add_argument("local_dir")
    inspect.add_argument("--hf_model_config_path", "--hf-model-config-path", dest="hf_model_config_path")
    inspect.add_argument(
        "--trust-remote-code", "--trust_remote_code", dest="trust_remote_code", action="store_true"
    )
    inspect.add_argument("--json", action="store_true", help="print JSON")

    watch = commands.add_parser("watch", help="announce each complete checkpoint of verl runs as a Prefect event")
    watch.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")

    serve = commands.add_parser(
        "serve", help="serve the merge-on-checkpoint and sweep deployments, with a watcher per run directory"
    )
    serve.add_argument("--watch", dest="run_dirs", action="append", required=True, metavar="RUN_DIR")
    _add_automation_options(serve)
    serve.add_argument("--schedule", default=None, metavar="CRON", help="cron schedule of the sweep (default: hourly)")
    serve.add_argument("--concurrency", type=int, default=1, help="merges at once (default 1)")
    _add_task_runner_option(serve)

    sweep = commands.add_parser("sweep", help="merge every complete checkpoint of verl runs not merged yet")
    sweep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    _add_automation_options(sweep)

    demo = commands.add_parser("demo", help="write a tiny real FSDP2 checkpoint and merge it")
    demo.add_argument(
        "--workdir", default=None, help="where to put the demo (default: a temporary directory)"
    )
    return parser


def run_merge(args: argparse.Namespace) -> int:
    from mergeflow.warm_up import start_warm_up

    start_warm_up(  # first: the disk starts reading while Prefect is imported
        args.local_dir,
        args.backend,
        args.hf_model_config_path,
        trust_remote_code=args.trust_remote_code,
        is_value_model=args.is_value_model,
    )
    from flows.merge import merge_checkpoint
    from flows.task_runners import task_runner_from

    flow = merge_checkpoint.with_options(task_runner=task_runner_from(args.task_runner))
    saved = flow(
        local_dir=args.local_dir,
        target_dir=args.target_dir,
        backend=args.backend,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        hf_model_config_path=args.hf_model_config_path,
        trust_remote_code=args.trust_remote_code,
        is_value_model=args.is_value_model,
        tie_word_embedding=args.tie_word_embedding,
        overwrite=args.overwrite,
        test_hf_dir=args.test_hf_dir,
        check_logits=args.check_logits,
        merge_lora=args.merge_lora,
        lora_alpha=args.lora_alpha,
        hf_upload_path=args.hf_upload_path,
        private=args.private,
        revision=args.revision,
        hf_token_secret=args.hf_token_secret,
        base_model=args.base_model,
        refresh_cache=args.refresh_cache,
        progress=args.progress,
    )
    print(f"merged {args.local_dir} -> {saved.target_dir} ({saved.num_tensors} tensors, {saved.dtype})")
    return 0


def run_test(args: argparse.Namespace) -> int:
    from flows.verify import verify_checkpoint

    report = verify_checkpoint(
        local_dir=args.local_dir,
        test_hf_dir=args.test_hf_dir,
        backend=args.backend,
        dtype=args.dtype,
        hf_model_config_path=args.hf_model_config_path,
        trust_remote_code=args.trust_remote_code,
        is_value_model=args.is_value_model,
        merge_lora=args.merge_lora,
        lora_alpha=args.lora_alpha,
        atol=args.atol,
        rtol=args.rtol,
    )
    print(f"{args.local_dir}: {report.tensors_compared} tensors equal {args.test_hf_dir}")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    from flows.validate import validate_folder

    report = validate_folder(
        target_dir=args.target_dir,
        test_hf_dir=args.test_hf_dir,
        check_logits=args.check_logits,
        atol=args.atol,
        rtol=args.rtol,
    )
    against = f", {report.tensors_compared} tensors equal {args.test_hf_dir}" if args.test_hf_dir else ""
    print(f"{args.target_dir}: complete{against}")
    if report.logits is not None:
        print(report.logits.message)
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from mergeflow.summary import describe_checkpoint, format_description

    description = describe_checkpoint(
        Path(args.local_dir),
        hf_model_config_path=args.hf_model_config_path,
        trust_remote_code=args.trust_remote_code,
    )
    print(json.dumps(description, indent=2) if args.json else format_description(description))
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from flows.demo import run_demo as demo

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="mergeflow-demo-"))
    return 0 if demo(workdir) else 1


def run_watch(args: argparse.Namespace) -> int:
    import time

    from deployments.watcher import watching

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with watching(args.run_dirs):
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0


def run_serve(args: argparse.Namespace) -> int:
    from deployments.serve import ServeOptions, serve_forever

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    serve_forever(
        ServeOptions(
            run_dirs=[str(Path(d).absolute()) for d in args.run_dirs],
            output_dir=str(Path(args.output_dir).absolute()),
            dtype=args.dtype,
            hf_upload_path=args.hf_upload_path,
            private=args.private,
            hf_token_secret=args.hf_token_secret,
            schedule=args.schedule,
            concurrency=args.concurrency,
            task_runner=args.task_runner,
        )
    )
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    from flows.sweep import sweep_checkpoints

    merged = sweep_checkpoints(
        run_dirs=[str(Path(d).absolute()) for d in args.run_dirs],
        output_dir=str(Path(args.output_dir).absolute()),
        dtype=args.dtype,
        hf_upload_path=args.hf_upload_path,
        private=args.private,
        hf_token_secret=args.hf_token_secret,
    )
    print(f"merged {len(merged)} checkpoint(s)" + "".join(f"\n  {target}" for target in merged))
    return 0


COMMANDS = {
    "merge": run_merge,
    "test": run_test,
    "validate": run_validate,
    "inspect": run_inspect,
    "demo": run_demo,
    "watch": run_watch,
    "serve": run_serve,
    "sweep": run_sweep,
}


class _HideExpectedTracebacks(logging.Filter):
    """Console logs show a bad-input error as its message; the traceback stays in the Prefect API logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], MergeflowError):
            record.exc_info = None
            record.exc_text = None
        return True


def _quiet_console_tracebacks() -> None:
    from prefect.logging.configuration import setup_logging

    setup_logging()
    loggers = [
        logging.getLogger(),
        *(logging.getLogger(name) for name in list(logging.root.manager.loggerDict)),
    ]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if type(handler).__name__ == "PrefectConsoleHandler":
                handler.addFilter(_HideExpectedTracebacks())


def main(argv: list[str] | None = None) -> int:
    for name, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(name, value)
    args = build_parser().parse_args(argv)
    if args.command in ("merge", "test", "validate", "demo", "sweep"):
        _quiet_console_tracebacks()
    try:
        return COMMANDS[args.command](args)
    except MergeflowError as e:
        print(f"mergeflow: error: {type(e).__name__}: {e}", file=sys.stderr)
        if isinstance(e, UploadError):
            print(f"mergeflow: the merged model is kept at {args.target_dir}", file=sys.stderr)
            return EXIT_UPLOAD_FAILED
        return EXIT_VALIDATION_FAILED if isinstance(e, ValidationError) else EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
