"""`nummon replay` reads every log format `watch` reads, with the alerts of the same JSONL trace."""

import json

import pytest

from nummon._cli import main

LOSSES = [2.0] * 15 + [2.0 * 6**k for k in range(1, 6)] + [float("nan")]


def _alerts(capsys, *args):
    assert main(["replay", "--format", "jsonl", *args]) == 0
    return [{k: v for k, v in json.loads(l).items() if k != "source"} for l in capsys.readouterr().out.splitlines()]


@pytest.mark.slow
def test_tensorboard_hf_and_csv_logs_give_the_jsonl_alerts(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(json.dumps({"step": i, "loss": str(v) if v != v else v}) + "\n" for i, v in enumerate(LOSSES))
    )
    want = _alerts(capsys, str(trace))
    assert any(a["severity"] == "warning" for a in want) and any(a["kind"] == "nonfinite" for a in want)

    tb = tmp_path / "tb"
    w = SummaryWriter(str(tb))
    for i, v in enumerate(LOSSES):
        w.add_scalar("train/loss", v, i)
    w.close()
    assert _alerts(capsys, str(tb)) == want

    hf = tmp_path / "trainer_state.json"
    rows = [{"step": i, "loss": v} for i, v in enumerate(LOSSES)]
    hf.write_text(json.dumps({"global_step": len(LOSSES), "log_history": rows}))  # bare NaN, as HF writes it
    assert _alerts(capsys, str(hf)) == want

    csv = tmp_path / "metrics.csv"
    csv.write_text("step,train_loss\n" + "".join(f"{i},{v}\n" for i, v in enumerate(LOSSES)))
    assert _alerts(capsys, str(csv)) == want


def test_a_file_that_is_not_a_log_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "notes.txt" in err[0]


def test_a_tensorboard_logdir_of_run_folders_replays_each_run(tmp_path, capsys):
    """`tensorboard --logdir DIR` style (the demo writes DIR/<run-name>/events...): each run is replayed."""
    from torch.utils.tensorboard import SummaryWriter

    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(json.dumps({"step": i, "loss": str(v) if v != v else v}) + "\n" for i, v in enumerate(LOSSES))
    )
    want = _alerts(capsys, str(trace))
    for run in ("run-a", "run-b"):
        w = SummaryWriter(str(tmp_path / "tb" / run))
        for i, v in enumerate(LOSSES):
            w.add_scalar("train/loss", v, i)
        w.close()
    assert _alerts(capsys, str(tmp_path / "tb")) == want + want
