"""Stage runs on real work pools: one ``prefect server start`` and process workers on two pools,
each with a concurrency limit of 1 (one GPU per pool), shared by the tests of this module.

Each test is what a user would try: the unattended deployment with a bad row skipped; a node
lost mid-part; a bad row without skipping; the server going away mid-run, briefly and for good.
"""

from __future__ import annotations

from collections import Counter
import json
import shutil
import signal
import time
from pathlib import Path

import pytest

from cache_store import open_cache
from diffsynth_core.training.checkpoint import CheckpointManager
from stages.demo import demo_config, write_demo_dataset, write_demo_model

from .pool_cluster import Cluster, _kill

SECRET = "SENTINEL-S3CRET-d41d8cd9"
FAST = ["orchestration.heartbeat_s=2", "orchestration.stale_after_s=8", "orchestration.retry_delay_s=1",
        "orchestration.poll_s=1", "train.save_steps=1", "train.max_steps=2"]
NO_VALIDATION = "train.validation_prompts=[]"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("pools")
    cluster = Cluster(root)
    try:
        cluster.start_server()
        for pool in ("cheap", "big"):
            cluster.create_pool(pool, limit=1)
        for pool in ("cheap", "big"):
            cluster.start_worker(pool)
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool-assets")
    write_demo_dataset(root / "dataset", count=32)  # the lost-node test needs parts long enough to kill
    write_demo_model(root / "model")
    return root


def _config(assets: Path, workdir: Path, *overrides: str, bad_row: int | None = None, rows: int = 16) -> Path:
    shutil.copytree(assets / "dataset", workdir / "dataset")
    metadata = workdir / "dataset" / "metadata.csv"
    metadata.write_text("\n".join(metadata.read_text().splitlines()[: rows + 1]) + "\n")
    if bad_row is not None:  # a corrupt image: what a user's dataset holds sooner or later
        row = metadata.read_text().splitlines()[bad_row + 1]
        (workdir / "dataset" / row.split(",")[0]).write_bytes(b"not a png")
    cfg = demo_config(workdir, overrides=[f"model.path={assets / 'model'}", "preprocess.parts=2", *FAST,
                                          *overrides])
    return cfg.save(workdir / f"{workdir.name}.toml")


def _finish(process, timeout: float = 400) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def _runs(cluster: Cluster, name: str) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with cluster.client() as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"run:{name}"])))


def _artifact(cluster: Cluster, run_id, key: str):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with cluster.client() as client:
        (artifact,) = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]), key=ArtifactFilterKey(any_=[key])))
    return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data


def _wait_final(cluster: Cluster, run_id, timeout: float = 400):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with cluster.client() as client:
            run = client.read_flow_run(run_id)
        if run.state.is_final():
            return run
        time.sleep(1)
    raise TimeoutError(f"flow run {run_id} not final after {timeout} s")


def _logs(cluster: Cluster, runs) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with cluster.client() as client:
        return [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(
            any_=[run.id for run in runs])))]


def _lines(err: str, text: str) -> list[str]:
    return [line for line in err.splitlines() if text in line]


def _state(cluster: Cluster, name: str, run_name: str):
    (run,) = [run for run in _runs(cluster, name) if run.name == run_name]
    return run.state


def _rows(path: Path) -> int:
    return len(path.read_text().splitlines()) - 1 if path.is_file() else 0


@pytest.fixture(scope="module")
def cache(assets, tmp_path_factory) -> str:
    """``cache.url=...`` of a complete cache of the 16-row dataset, encoded in this process (no worker runs):
    for the tests about training, whose configs share it (entries are keyed by content)."""
    from stages import preprocess
    from stages.config import load_config

    config = _config(assets, tmp_path_factory.mktemp("encoded") / "encoded")
    cfg = load_config(config)
    for part in range(cfg.preprocess.parts):
        preprocess.run(cfg, part)
    return f"cache.url={cfg.cache_url}"


def test_deployed_run_skips_a_bad_row_and_shows_names_tags_logs_artifacts(cluster, assets, tmp_path):
    """The unattended form: deploy, a control-pool worker, one trigger; nothing secret reaches Prefect."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    config = _config(assets, tmp_path / "skipper", "dataset.skip_bad_samples=true",
                     f'cache.storage_options={{secret_token="{SECRET}"}}',  # a literal: the worst case
                     'train.validation_prompts=["a red circle"]', "train.validation_steps=2",
                     "train.validation_inference_steps=2", bad_row=5)
    code, out, err = _finish(cluster.splitflow("deploy", str(config), "--preprocess-pool", "cheap",
                                               "--train-pool", "big", "--control-pool", "control"))
    assert code == 0, err
    assert json.loads(out[out.index("{"):])["pools_created"] == ["control"]
    cluster.start_worker("control")
    with temporary_settings(updates={PREFECT_API_URL: cluster.url}):
        parent = run_deployment("splitflow-coordinate/skipper", timeout=0)
    parent = _wait_final(cluster, parent.id)
    assert parent.state.is_completed(), parent.state.message

    cfg_output = tmp_path / "skipper" / "output"
    assert (cfg_output / "lora.safetensors").is_file()
    store = open_cache(tmp_path / "skipper" / "cache.zarr")
    assert len(store.require_complete()) == 2 * 15 and [v["row"] for v in store.skipped().values()] == [5]

    runs = {run.name: run for run in _runs(cluster, "skipper")}
    assert {"skipper/preprocess part 1 of 2", "skipper/preprocess part 2 of 2", "skipper/train"} <= set(runs)
    part2 = runs["skipper/preprocess part 2 of 2"]
    assert {"splitflow", "run:skipper", "family:qwen_image", "stage:preprocess", "part:1"} <= set(part2.tags)
    assert any(tag.startswith("config:") for tag in part2.tags)
    assert all(run.state.is_completed() for run in runs.values())
    with cluster.client() as client:
        artifacts = {a.key: a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[r.id for r in runs.values()])))}
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id for r in runs.values()])))
        deployments = client.read_deployments()
    table = json.loads(artifacts["skipper-preprocess-part-2-of-2"].data)
    skipped = [row for row in table if row["outcome"] == "skipped"]
    assert len(skipped) == 1 and skipped[0]["row"] == 5 and skipped[0]["file"].endswith(".png") and skipped[0]["reason"]
    assert "| final loss |" in artifacts["skipper-train-summary"].data
    assert artifacts["skipper-loss-curve"].data.startswith("data:image/png;base64,")
    assert artifacts["skipper-validation-0"].data.startswith("data:image/png;base64,")
    assert artifacts["skipper-train-progress"].data == 100
    messages = [log.message for log in logs]
    assert any("preprocess (part 2/2)" in m and "1 bad rows skipped" in m for m in messages)  # the stage's own line
    assert any("skipper/train: step 2 of 2" in m for m in messages)
    assert not [m for m in messages if "\x1b" in m or "\r" in m]  # no terminal codes in run logs
    own = _logs(cluster, [parent])  # the coordinator's lines in its run's logs (it ran as `deployments.*`)
    assert parent.name == "skipper" and any("skipper/train: completed" in m for m in own), own
    assert any("15 encoded now, 1 bad rows skipped" in m for m in own), own  # what the parts encoded
    everything = json.dumps([r.model_dump(mode="json") for r in runs.values()] + messages
                            + [a.model_dump(mode="json") for a in artifacts.values()]
                            + [d.model_dump(mode="json") for d in deployments])
    assert str(config) in everything and SECRET not in everything


def _wait_for(predicate, what: str, timeout: float = 300, process=None):
    deadline = time.monotonic() + timeout
    while not predicate():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"splitflow exited before {what}: {process.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _committed(cache: Path) -> int:
    try:
        return len(open_cache(cache).keys())
    except Exception:  # noqa: BLE001 -- not created yet
        return 0


def test_a_node_lost_mid_part_is_resubmitted_and_nothing_is_encoded_twice(cluster, assets, tmp_path):
    """SIGKILL the cheap pool's worker and its flow-run process mid-part; start a new worker later."""
    config = _config(assets, tmp_path / "lost", "preprocess.commit_every=1", rows=32)
    run = cluster.splitflow("run", str(config), "--preprocess-pool", "cheap", "--train-pool", "big")
    cache = tmp_path / "lost" / "cache.zarr"
    _wait_for(lambda: 2 <= _committed(cache), "the first entries of a part", process=run)
    cluster.kill_node("cheap")
    before = _committed(cache)
    assert before < 2 * 16, "the part finished before the node was lost"  # two entries a row
    _wait_for(lambda: any(r.state.is_crashed() for r in _runs(cluster, "lost")), "the lost run marked Crashed",
              process=run)
    cluster.start_worker("cheap")
    code, out, err = _finish(run)
    assert code == 0, err[-3000:]

    store = open_cache(cache)
    assert len(store.require_complete()) == 2 * 32 and store.duplicates == 0  # two entries a row
    manifests = [json.loads(p.read_text()) for p in (cache / "manifests").glob("*.json")]
    committed = Counter(rec["key"] for m in manifests for rec in m["entries"])  # rows and the empty prompt
    assert max(committed.values()) == 1, committed.most_common(3)  # every entry committed exactly once
    assert set(committed) - set(store.keys()) == {k for k in committed if k.startswith("aux.empty-prompt.")}
    runs = _runs(cluster, "lost")
    lost = [r for r in runs if r.state.is_crashed()]
    assert len(lost) == 1 and "no heartbeat" in lost[0].state.message
    label = lost[0].name
    again = [r for r in runs if r.name == f"{label} (attempt 2)"]
    assert len(again) == 1 and again[0].state.is_completed() and "attempt:2" in again[0].tags
    part = int(label.split()[-3])  # "lost/preprocess part K of 2"
    table = _artifact(cluster, again[0].id, f"lost-preprocess-part-{part}-of-2")
    counts = {row["outcome"]: row["rows"] for row in table}
    done_rows = before // 2  # a row is cached once both its entries are (target latents, conditioning)
    assert counts == {"encoded": 16 - done_rows, "reused": done_rows}  # only what was missing
    summary = json.loads(out[out.index("{"):])
    assert summary["train"]["steps"] == 2
    # what the parts encoded (16 - done_rows and 16): the summary counts them, as their tables do
    assert (summary["preprocess"]["encoded"], summary["preprocess"]["reused"]) == (32 - done_rows, done_rows)
    coordinator = [r for r in runs if r.name == "lost"]  # the caller's coordinator run holds its warnings
    assert any(f"{label}: attempt 1 crashed" in m and "re-submitting" in m for m in _logs(cluster, coordinator))


def test_a_bad_row_without_skipping_fails_once_and_at_once(cluster, assets, tmp_path):
    config = _config(assets, tmp_path / "strict", "preprocess.parts=1", "preprocess.retries=2", bad_row=3)
    code, out, err = _finish(cluster.splitflow("run", str(config), "--preprocess-pool", "cheap",
                                               "--train-pool", "big"))
    assert code == 2, err[-3000:]
    bad = (tmp_path / "strict" / "dataset" / "metadata.csv").read_text().splitlines()[4].split(",")[0]
    assert "Traceback" not in err
    error = [line for line in err.splitlines() if line.startswith("splitflow run: error:")]
    assert len(error) == 1 and bad in error[0] and "index 3" in error[0] and "part 1 of 1" in error[0]
    runs = {run.name: run for run in _runs(cluster, "strict")}
    assert set(runs) == {"strict/preprocess part 1 of 1", "strict"}  # the part, and the CLI's coordinator run
    assert all(run.state.is_failed() and run.state.message.startswith("[splitflow:input]") for run in runs.values())
    home = Path(cluster.env["PREFECT_HOME"])  # PREFECT_API_URL set: no private server was started
    assert not list(home.glob("splitflow-server-*")) and not (home / "server.log").exists()


def test_a_server_outage_longer_than_the_grace_period_then_a_rerun(cluster, assets, cache, tmp_path):
    """Stop the server mid-training: the CLI gives up after the grace period in one line (exit 3),
    training goes on on its worker; once the server is back, a re-run completes and no run is left open."""
    config = _config(assets, tmp_path / "outage", cache, "orchestration.api_grace_s=5", "train.max_steps=8",
                     NO_VALIDATION)
    run = cluster.splitflow("run", str(config), "--preprocess-pool", "cheap", "--train-pool", "big")
    metrics = tmp_path / "outage" / "output" / "metrics.csv"
    _wait_for(metrics.is_file, "training to start", process=run)
    cluster.stop_server()
    code, out, err = _finish(run, timeout=120)
    assert code == 3, err[-3000:]
    assert "Traceback" not in err
    error = [line for line in err.splitlines() if line.startswith("splitflow run: error:")]
    assert len(error) == 1 and "unreachable" in error[0] and "Work on disk is kept" in error[0], err
    cluster.start_server()

    code, out, err = _finish(cluster.splitflow("run", str(config), "--preprocess-pool", "cheap",
                                               "--train-pool", "big"))
    assert code == 0, err[-3000:]
    assert json.loads(out[out.index("{"):])["train"]["steps"] == 8
    runs = _runs(cluster, "outage")
    assert runs and all(r.state.is_final() for r in runs), [(r.name, r.state.type) for r in runs]
    assert [r.name for r in runs if r.name.endswith("/train")] == ["outage/train"]  # adopted, not re-run


def test_an_orphaned_run_frees_its_slot_for_another_config_and_a_stopped_caller_cancels_its_queued_run(
        cluster, assets, cache, tmp_path):
    """Issue 48. A's caller, big worker and flow-run process SIGKILLed mid-training leave a/train Running on the
    big pool (limit 1). B's first caller finds it silent past a's own stale_after_s, marks it lost in one line, and
    is stopped by SIGTERM while b/train waits for a worker: it cancels b/train and says so. B's next caller trains."""
    a = _config(assets, tmp_path / "a", cache, "train.max_steps=400", "orchestration.stale_after_s=4", NO_VALIDATION)
    b = _config(assets, tmp_path / "b", cache, NO_VALIDATION)
    pools = ["--preprocess-pool", "cheap", "--train-pool", "big"]
    run_a = cluster.splitflow("run", str(a), *pools)
    _wait_for(lambda: _rows(tmp_path / "a" / "output" / "metrics.csv") >= 1, "a's training", process=run_a)
    _kill([run_a.pid], signal.SIGKILL)
    cluster.kill_node("big")  # no big worker until B's first caller is stopped: b/train stays queued

    first_b = cluster.splitflow("run", str(b), *pools)
    _wait_for(lambda: "b/train" in {r.name for r in _runs(cluster, "b")} and _state(cluster, "a", "a/train")
              .is_crashed(), "b/train queued and a/train found lost", process=first_b)
    first_b.send_signal(signal.SIGTERM)
    code, _, err = _finish(first_b, timeout=60)
    assert code == 130, err[-3000:]
    freed = _lines(err, "no heartbeat")
    assert len(freed) == 1 and "a/train" in freed[0] and "pool big freed" in freed[0], err[-3000:]
    assert len(_lines(err, "stopped: cancelled b/train")) == 1, err[-3000:]
    assert "no heartbeat" in _state(cluster, "a", "a/train").message

    cluster.start_worker("big")
    code, out, err = _finish(cluster.splitflow("run", str(b), *pools))
    assert code == 0, err[-3000:]
    assert json.loads(out[out.index("{"):])["train"]["steps"] == 2
    runs = _runs(cluster, "b")
    named = {run.name: run for run in runs}
    assert named["b/train"].state.is_cancelled() and named["b/train (attempt 2)"].state.is_completed()
    assert not [name for name in named if "preprocess" in name]  # b trains on the shared cache: nothing to encode
    coordinators = [run for run in runs if run.name == "b"]  # one per caller
    assert sorted(run.state.type.value for run in coordinators) == ["CANCELLED", "COMPLETED"]
    logs = _logs(cluster, coordinators)  # each holds its caller's lines: read back through the API
    assert any("a/train: no heartbeat" in m for m in logs) and any("stopped: cancelled b/train" in m for m in logs)
    assert any("b/train: completed" in m for m in logs), logs


def test_the_plain_cli_path_on_a_server_outage_one_line_then_reruns_close_what_was_left(
        cluster, assets, cache, tmp_path):
    """Issue 48: `splitflow run` without pools, PREFECT_API_URL set, the server stopped mid-training. The verb whose
    work remains exits 3 within api_grace_s in one line; the one whose work finishes exits 0, saying the server
    could not be told. With the server back, a verb of each run name closes the runs its verb left Running (from
    disk: Completed or Crashed), with nothing left for it to do, and no run stays open."""
    long = _config(assets, tmp_path / "long", cache, "train.max_steps=400", "orchestration.api_grace_s=5",
                   NO_VALIDATION)
    short = _config(assets, tmp_path / "short", cache, "train.max_steps=4", "orchestration.api_grace_s=12",
                    NO_VALIDATION)
    run_long, run_short = cluster.splitflow("run", str(long)), cluster.splitflow("run", str(short))
    _wait_for(lambda: _rows(tmp_path / "short" / "output" / "metrics.csv") >= 1, "short's training",
              process=run_short)
    run_short.send_signal(signal.SIGSTOP)  # its last steps are taken once the server is gone
    _wait_for(lambda: _rows(tmp_path / "long" / "output" / "metrics.csv") >= 1, "long's training", process=run_long)
    cluster.stop_server()
    stopped = time.monotonic()
    run_short.send_signal(signal.SIGCONT)
    code, out, err = _finish(run_long, timeout=60)
    assert code == 3 and time.monotonic() - stopped < 5 + 4, err[-3000:]  # the grace, a health check, the exit
    assert len(_lines(err, "splitflow run: error: Prefect API")) == 1 and "Work on disk is kept" in err
    for noise in ("Traceback", "EventsWorker", "Finished in state Running", "Another attempt"):  # minutes of it
        assert noise not in err, err[-3000:]
    code, out, err = _finish(run_short, timeout=60)
    assert code == 0 and time.monotonic() - stopped < 12 + 4, err[-3000:]
    note = _lines(err, "splitflow run: note: the work is done")
    assert len(note) == 1 and "could not be told" in note[0] and "Traceback" not in err, err[-3000:]
    assert json.loads(out[out.index("{"):])["train"]["steps"] == 4
    cluster.start_server()

    reruns = [(cluster.splitflow(verb, str(config)), closed)  # both at once
              for config, verb, closed in ((short, "run", "Completed"), (long, "preprocess", "Crashed"))]
    for rerun, closed in reruns:
        code, out, err = _finish(rerun)
        assert code == 0, err[-3000:]
        result = json.loads(out[out.index("{"):])  # nothing left for this verb: answered from disk, runs closed
        assert "nothing left to do" in result["note"] and closed in result["reconciled"], result
    for name in ("long", "short"):
        runs = _runs(cluster, name)
        assert runs and all(run.state.is_final() for run in runs), [(r.name, r.state.type) for r in runs]
        assert not [m for m in _logs(cluster, runs) if "\x1b" in m or "\r" in m]  # no terminal codes in run logs


def test_status_with_a_server_frees_a_slot_a_silent_run_holds(cluster, assets, tmp_path):
    """`splitflow status` of any config, PREFECT_API_URL set: a stage run holding a pool slot with no heartbeat for
    its own stale_after_s is marked lost in one line (as a coordinator does every poll)."""
    from prefect.states import Running

    from flows.deployments import train_stage_flow

    with cluster.client() as client:
        silent = client.create_flow_run(train_stage_flow, name="gone/train", work_pool_name="big", state=Running(),
                                        tags=["splitflow", "run:gone", "stage:train", "stale_after_s:1"])
    time.sleep(1.5)
    code, out, err = _finish(cluster.splitflow("status", str(_config(assets, tmp_path / "other"))))
    assert code == 0, err[-3000:]
    assert json.loads(out[out.index("{"):])["prefect"]["reachable"] is True
    freed = _lines(err, "splitflow status: gone/train: no heartbeat")
    assert len(freed) == 1 and "pool big freed" in freed[0], err[-3000:]
    with cluster.client() as client:
        assert client.read_flow_run(silent.id).state.is_crashed()
