"""The ``splitflow`` command line.

Each verb loads a ``RunConfig`` (file + ``--set`` overrides + DiffSynth-style flags), calls one
flow or one stage, prints a summary and exits non-zero on failure.  What is left to do is read
from disk first: a run with nothing left answers without Prefect.  Otherwise Prefect is
imported only after its environment (``PREFECT_HOME`` inside the output folder) is set, and the
verb uses ``PREFECT_API_URL`` or a private server of its own (flows/server.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from diffsynth_core.errors import EXIT_BUG, EXIT_INPUT, InputError, Interrupted, classify
from flows.signals import StopSignals
from stages.compat import diffsynth
from stages.config import ConfigError, RunConfig

DEFAULT_DEMO_DIR = "splitflow-demo"


def _config(args, extra) -> RunConfig:
    """CONFIG file (optional), then DiffSynth-Studio flags, then --set: stages/compat/diffsynth.py."""
    from flows.secrets import register_prefect_secrets

    register_prefect_secrets()  # storage options may name Prefect Secret blocks (resolved where used)
    return diffsynth.run_config_from_cli(args.config, args.set, extra, args.verb)


def _reference(args, extra, cfg: RunConfig) -> tuple[str, list[str]]:
    """How flow runs load this config again: a CONFIG file as its path plus ``--set``; a command line
    with DiffSynth-Studio flags (or no CONFIG) as the resolved config saved under the output folder."""
    from flows.runconfig import config_reference

    if args.config is not None and not extra:
        return config_reference(args.config), list(args.set)
    saved = cfg.save(cfg.output_dir / ".splitflow" / f"{args.verb}-config.toml")  # references stay references
    return str(saved.resolve()), []


def _run_name(args, cfg: RunConfig) -> str:
    """``--name``, else the config's name; with no CONFIG, the output folder's (``run_name``)."""
    from flows.runconfig import run_name

    return run_name(args.config or str(cfg.output_dir / "config.toml"), args.name)


def _print(result) -> None:
    print(json.dumps(result, indent=2, default=str))


def _run_stages(args, extra, stages: tuple[str, ...], cfg: RunConfig | None = None) -> int:
    from flows.orchestrate import orchestrate
    from stages.precheck import check_inputs, first_run_cleanup, length_note

    cfg = cfg or _config(args, extra)
    pools = {"preprocess": getattr(args, "preprocess_pool", None), "train": getattr(args, "train_pool", None)}
    if not any(pools.values()):  # on work pools the data and the model are where the workers are
        rows = check_inputs(cfg, stages)  # from disk, before anything is written or Prefect starts
        if "train" in stages and (note := length_note(cfg, rows)):
            print(f"splitflow {args.verb}: note: {note}", file=sys.stderr)
    with first_run_cleanup(cfg):
        ref, overrides = _reference(args, extra, cfg)
        name = _run_name(args, cfg)
        _print(orchestrate(cfg, ref, overrides, name, stages, pools, args.debug, args.verb))
    return 0


# -- verbs -------------------------------------------------------------------------------------
def cmd_demo(args, extra) -> int:
    from stages.demo import prepare_demo

    import torch

    workdir = Path(args.workdir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # One CPU thread: the tiny model's kernels are too small to share cores (its training takes 1.4 s instead of
    # 11 s on two cores), and threads started later (Prefect's task threads) take this count too.
    torch.set_num_threads(1)
    overrides = diffsynth.flag_overrides(extra) + list(args.set)
    if args.variant:  # an edit model and (reference, instruction, target) triples
        from stages.demo_edit import prepare_edit_demo

        cfg, config_path = prepare_edit_demo(workdir, args.variant, overrides)
    else:
        cfg, config_path = prepare_demo(workdir, args.family, overrides)
    print(f"demo: dataset, tiny {args.variant or args.family} model and {config_path} ready in {workdir}")
    args.config, args.set, args.name = str(config_path), [], args.name or workdir.resolve().name
    _run_stages(args, [], ("preprocess", "train"))
    from stages.demo import loss_trend
    from stages.status import metric_rows

    output = workdir / "output"
    rendered = (f"; validation images (one every {cfg.train.validation_steps} steps) in {output / 'validation'}"
                if cfg.train.validation_prompts else "")
    print(f"{loss_trend(metric_rows(cfg))}{rendered}")
    print(f"outputs in {output}; rerun any verb with: splitflow <verb> {config_path}")
    return 0


def cmd_run(args, extra) -> int:
    return _run_stages(args, extra, ("preprocess", "train"))


def cmd_preprocess(args, extra) -> int:
    if args.part is not None:  # one part, no orchestration: what a worker machine runs
        from stages import preprocess
        from stages.precheck import check_inputs

        cfg = _config(args, extra)
        check_inputs(cfg, ("preprocess",))
        print(preprocess.run(cfg, args.part).describe())
        return 0
    return _run_stages(args, extra, ("preprocess",))


def cmd_train(args, extra) -> int:
    # No orchestration: what each rank of `torchrun ... -m flows.cli train CONFIG --in-process` runs.
    if args.in_process:
        from stages import train
        from stages.precheck import check_inputs

        cfg = _config(args, extra)
        check_inputs(cfg, ("train",))
        print(train.run(cfg).describe())
        return 0
    return _run_stages(args, extra, ("train",))


def cmd_status(args, extra) -> int:
    from flows.server import configured_api_url
    from stages.status import read_cache, run_status, work_left

    from stages.precheck import input_problem, input_rows, length_note

    cfg = _config(args, extra)
    problem = input_problem(cfg)  # a missing dataset or model is flagged, not hidden behind "nothing cached"
    status = {"inputs": problem or "ok"}
    if problem is None:
        view = read_cache(cfg)  # the dataset keyed and the cache read once for both answers
        status.update(run_status(cfg, view), left=work_left(cfg, view).as_dict())
    else:  # the cache and the steps cannot be counted against inputs that are not there
        status["train"] = run_status(cfg)["train"] if cfg.output_dir.is_dir() else {"output": str(cfg.output_dir),
                                                                                        "step": 0}
    rows = None if problem else input_rows(cfg)
    if note := length_note(cfg, rows):
        status["length"] = note
    if url := configured_api_url():  # a server: stage runs nobody watches any more give their pool slots back
        status["prefect"] = _free_lost_slots(cfg, url)
    _print(status)
    return 0


def _free_lost_slots(cfg: RunConfig, url: str) -> dict:
    from flows.coordinator import free_lost_slots_now
    from flows.orchestrate import prefect_environment

    # Prefect's home: the output's when it exists (a status creates no output folder)
    prefect_environment(cfg.output_dir if cfg.output_dir.is_dir() else Path(tempfile.gettempdir()) / "splitflow")
    prefect = free_lost_slots_now(cfg.orchestration.stale_after_s, url)
    for line in prefect.get("freed", []):
        print(f"splitflow status: {line}", file=sys.stderr)
    return prefect


def cmd_resume(args, extra) -> int:
    from stages.status import run_status, work_left

    from stages.precheck import check_inputs

    cfg = _config(args, extra)
    check_inputs(cfg, ("preprocess", "train"))
    status = run_status(cfg)
    done = f"cache {status['cache']['present']}/{status['cache']['expected']} entries, " \
           f"training at step {status['train']['step']}"
    if work_left(cfg).nothing:
        print(f"nothing to resume: {done}, exported")
    else:
        print(f"resuming: {done}")
    return _run_stages(args, extra, ("preprocess", "train"), cfg)


def cmd_deploy(args, extra) -> int:
    from flows.orchestrate import check_lora_targets_first, prefect_session
    from flows.runconfig import check_overrides
    from flows.server import configured_api_url

    cfg = _config(args, extra)
    # Checked as orchestrate does, before prefect_session may wait api_grace_s for the API.
    if not (args.preprocess_pool and args.train_pool):
        raise ConfigError("deploy needs --preprocess-pool and --train-pool (work pools; see docs/orchestration.md)")
    url = configured_api_url()  # before PREFECT_HOME moves: the user's profile may name their server
    ref, overrides = _reference(args, extra, cfg)
    check_overrides(overrides)  # overrides become deployment parameters: no credentials there
    check_lora_targets_first(cfg, ("train",), local=False)  # as orchestrate does for pooled runs
    with prefect_session(cfg, url, True, args.debug):
        from flows.deployments import deploy  # imports Prefect: after prefect_session set its home

        pools = {"preprocess": args.preprocess_pool, "train": args.train_pool}
        _print(deploy(cfg, ref, overrides, _run_name(args, cfg), pools, args.control_pool))
    return 0


def cmd_cache(args, extra) -> int:
    from cache_store.report import format_inspect, inspect_cache

    if args.action == "import":
        return _cache_import(args)
    if Path(args.path).is_file() and Path(args.path).suffix in (".toml", ".yaml", ".yml", ".json"):
        cfg = _config(argparse.Namespace(config=args.path, set=[], verb="cache"), [])
        raise InputError(f"{args.path} is a run config, not a cache: splitflow cache {args.action} takes the "
                         f"cache itself, here its cache.url: splitflow cache {args.action} {cfg.cache_url}")
    report = inspect_cache(args.path, verify=args.action == "verify")
    print(format_inspect(report))
    # No cache at PATH is the same mistake for both (exit 2); a cache inspect can read is fine to inspect.
    if "error" in report:
        return EXIT_INPUT
    return 0 if args.action == "inspect" or report.get("ok", False) else EXIT_INPUT  # a bad cache is input


def _cache_import(args) -> int:
    from stages.compat.diffsynth_cache import import_cache

    if not args.dest:
        raise InputError("splitflow cache import SRC DEST: DEST (the new cache, e.g. out/cache.zarr) is missing")
    summary = import_cache(args.path, args.dest, family=args.family, backend=args.backend)
    print(f"imported {summary['imported']} of {summary['files']} DiffSynth samples ({summary['family']}, "
          f"{summary['already_present']} already present) into {summary['cache']}; train with "
          f"--set cache.url={summary['cache']} --set model.family={summary['family']}")
    return 0


VERBS = {
    "demo": (cmd_demo, "build the tiny demo (dataset + real-architecture model) and run both stages"),
    "run": (cmd_run, "run preprocess then train for CONFIG (resumes whatever is already done)"),
    "preprocess": (cmd_preprocess, "stage 1: encode prompts and pixels into the cache"),
    "train": (cmd_train, "stage 2: train from the cache, resuming from the last checkpoint"),
    "resume": (cmd_resume, "show what is done, then continue the failed or stopped stages"),
    "status": (cmd_status, "report cache completeness and training progress, without running anything"),
    "deploy": (cmd_deploy, "register the stages as Prefect deployments on work pools"),
    "cache": (cmd_cache, "inspect or verify a cache (zarr or pth), or import a DiffSynth-Studio cache"),
}


DIFFSYNTH_FLAGS = ("Every verb that takes CONFIG also takes DiffSynth-Studio's flags (--dataset_base_path, "
                   "--dataset_metadata_path, --model_id_with_origin_paths, --lora_rank, --learning_rate, "
                   "--enable_model_cpu_offload, ...), with or without a CONFIG: the table is in docs/diffsynth.md.")


def build_parser() -> argparse.ArgumentParser:
    from diffsynth_core.models import known_families

    parser = argparse.ArgumentParser(
        prog="splitflow",
        description="Fine-tune diffusion transformers on small GPUs: preprocess (encoders -> cache), "
                    "then train (DiT or LoRA from the cache, weights offloaded). Try: splitflow demo",
        epilog=DIFFSYNTH_FLAGS,
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name, (_, help_text) in VERBS.items():
        sub = verbs.add_parser(name, help=help_text, description=help_text,
                               epilog=DIFFSYNTH_FLAGS if name not in ("cache", "demo") else None)
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show the traceback of a failure")
        if name == "cache":
            sub.add_argument("action", choices=["inspect", "verify", "import"])
            sub.add_argument("path", help="cache URL or folder (e.g. out/cache.zarr, s3://bucket/cache.zarr); "
                                          "for import: the DiffSynth cache folder (its <rank>/<i>.pth files)")
            sub.add_argument("dest", nargs="?", help="import: the splitflow cache to create or extend")
            sub.add_argument("--family", help="import: model family (default: recognised from the files)")
            sub.add_argument("--backend", choices=["zarr", "pth"], help="import: cache backend (default zarr)")
            continue
        if name == "demo":
            sub.add_argument("--workdir", default=DEFAULT_DEMO_DIR, help="where the demo writes everything")
            sub.add_argument("--family", default="qwen_image", choices=known_families(),
                             help="model family of the tiny model: %(choices)s (default: %(default)s)")
            sub.add_argument("--variant", choices=["edit", "edit-2509", "edit-2511"],
                             help="an image-edit demo: a tiny Qwen-Image-Edit model of this variant")
        else:
            sub.add_argument("config", nargs="?", help="run config (TOML or YAML; see examples/); optional "
                                                       "when DiffSynth-Studio flags give the model and data")
        sub.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                         help="override a config value, e.g. --set train.max_steps=100 (repeatable)")
        if name in ("run", "resume", "preprocess", "train", "deploy", "demo"):
            sub.add_argument("--name", help="run name for Prefect runs, deployments and artifacts "
                                             "(default: the config file's name)")
        if name == "preprocess":
            sub.add_argument("--part", type=int, help="encode only this part (0-based) of preprocess.parts")
        if name == "train":
            sub.add_argument("--in-process", action="store_true",
                             help="run the stage in this process without Prefect (e.g. one rank under torchrun)")
        if name in ("run", "resume", "preprocess", "deploy"):
            sub.add_argument("--preprocess-pool", help="work pool whose workers run the preprocess parts "
                                                      "(needs PREFECT_API_URL; see docs/orchestration.md)")
        if name in ("run", "resume", "train", "deploy"):
            sub.add_argument("--train-pool", help="work pool whose worker runs training")
        if name == "deploy":
            sub.add_argument("--control-pool", default="splitflow-control",
                             help="light work pool (no GPU) for the coordinating run; created if missing")
    return parser


def _close_progress_bars() -> None:
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def report_failure(verb: str, err: BaseException, debug: bool) -> int:
    """One line naming what failed and what to do; the documented exit code (README, DESIGN).

    2: the user's input (config, data, cache); 3: the environment (disk, permissions, network,
    server, a lock held elsewhere); 130: interrupted; 1: a bug.  ``--debug`` adds the traceback.
    """
    import traceback

    classified = classify(err)
    _close_progress_bars()  # a bar left open by the failure would print itself after the error line
    if debug:
        traceback.print_exception(err, file=sys.stderr)
    if classified is None:
        print(f"splitflow {verb}: internal error: {type(err).__name__}: {err} "
              f"(a bug: re-run with --debug for the traceback and report it)", file=sys.stderr)
        return EXIT_BUG
    kind = "" if isinstance(classified, Interrupted) else "error: "
    print(f"splitflow {verb}: {kind}{classified}", file=sys.stderr)
    return classified.exit_code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # DiffSynth-Studio flags (--dataset_base_path ...) leave argv first: mapped per verb in _config.
    own, diffsynth_flags = diffsynth.split_argv(sys.argv[1:] if argv is None else list(argv))
    args, extra = parser.parse_known_args(own)
    extra = diffsynth_flags + extra
    code = _run_verb(args, extra, restore_signals=argv is not None)
    common = sys.modules.get("stages.common")  # never imported: no process group was joined
    if argv is None and common is not None and common.joined_process_group():
        _leave_rank(code)
    return code


def _leave_rank(code: int) -> None:
    """End a process that joined a torchrun group now, its work done and on disk: in the
    interpreter's teardown, gloo's threads abort a finished rank now and then ("terminate called
    without an active exception", SIGABRT: torchrun then reports the whole run failed), even with
    the process group destroyed (``stages.common.leaving_process_group``)."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_verb(args: argparse.Namespace, extra: list[str], restore_signals: bool) -> int:
    with StopSignals(args.verb, restore=restore_signals) as signals:  # SIGTERM like Ctrl-C: servers stopped, work kept
        try:
            try:
                return VERBS[args.verb][0](args, extra)
            except Exception as err:  # noqa: BLE001 -- the one place where failures become exit codes
                if signals.received:  # a library caught the interrupt and raised its own error without it
                    raise KeyboardInterrupt(signals.received[0].name) from err
                return report_failure(args.verb, err, args.debug)
        except BaseException as stopped:  # an interrupt, also one landing while a failure is reported
            if not isinstance(classify(stopped), Interrupted):
                raise  # SystemExit: argparse's, or a verb's own
            signals.absorb()  # the verb ends now: a re-sent or second signal must not kill it mid-line
            return report_failure(args.verb, stopped, args.debug)


if __name__ == "__main__":
    sys.exit(main())
