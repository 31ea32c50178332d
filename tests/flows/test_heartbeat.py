"""What a training heartbeat reports: a resumed attempt's first step is the checkpoint it resumes from."""

from flows.heartbeat import _ResumedSteps
from stages.demo import demo_config


def _metrics(path, steps) -> None:
    path.write_text("step,epoch,loss\n" + "".join(f"{step},0,{step / 10}\n" for step in steps))


def test_a_resumed_attempt_reports_its_checkpoint_until_it_writes(tmp_path):
    cfg = demo_config(tmp_path)
    checkpoints = cfg.output_dir / "checkpoints"
    (checkpoints / "step-00000003").mkdir(parents=True)
    (checkpoints / "step-00000003" / "state.pt").write_bytes(b"")
    (checkpoints / "latest").write_text("step-00000003")
    _metrics(cfg.output_dir / "metrics.csv", range(1, 6))  # the killed attempt logged steps 4 and 5 too
    resumed = _ResumedSteps(cfg)
    assert resumed.progress() == (3, 0.3)  # steps 4 and 5 are trained again
    _metrics(cfg.output_dir / "metrics.csv", range(1, 5))  # this attempt truncated the file, then logged step 4
    assert resumed.progress() == (4, 0.4)


def test_a_fresh_run_reports_what_it_logs(tmp_path):
    cfg = demo_config(tmp_path)
    resumed = _ResumedSteps(cfg)
    assert resumed.progress() == (0, None)
    cfg.output_dir.mkdir(parents=True)
    _metrics(cfg.output_dir / "metrics.csv", [1, 2])
    assert resumed.progress() == (2, 0.2)
