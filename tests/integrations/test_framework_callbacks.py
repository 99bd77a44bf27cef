"""The scenarios every framework callback must pass, run over both (Lightning and the Hugging Face
Trainer) on real trainers with tiny models built on the spot. Each framework's runs live in
helpers/lightning_runs.py / helpers/transformers_runs.py (one adapter each: build the model, run the trainer, say
what happened in nummon's step numbers); what only one framework has stays in test_lightning.py
and test_transformers.py.
"""

import inspect
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from helpers.incident_series import expected_series  # noqa: E402
from helpers.wandb_reader import find_run_file, nummon_alert_titles_and_steps, read_records  # noqa: E402

from nummon import MemorySink, Severity  # noqa: E402

pytestmark = pytest.mark.slow  # real Lightning and Hugging Face trainers, one run each

FP16_MAX = 65504.0  # "blown up": a loss that half precision could no longer even represent
FRAMEWORKS = ["lightning", "transformers"]


@pytest.fixture(scope="module", params=FRAMEWORKS)
def fw(request):
    """The framework's adapter module (skipped where the framework is not installed)."""
    return pytest.importorskip(f"helpers.{request.param}_runs")


@pytest.fixture(scope="module")
def unmonitored_runaway(fw, tmp_path_factory):
    """The runaway without nummon: {step: loss} and the first step that is lost."""
    run = fw.runaway(tmp_path_factory.mktemp("plain"))
    first_bad = min(s for s, v in run.losses.items() if not math.isfinite(v) or v > FP16_MAX)
    return run.losses, first_bad


def warnings_of(cb):
    return [a for a in cb.monitor.alerts if a.severity.rank >= Severity.WARNING.rank]


def test_runaway_without_nummon_is_lost(fw, unmonitored_runaway):
    losses, first_bad = unmonitored_runaway
    # far beyond what any precision can train on (whether it reaches NaN within the run depends
    # on the CPU's summation order: one thread or two, AVX2 or AVX-512 kernels)
    assert any(math.isnan(v) or v > 1e15 for v in losses.values()), losses
    assert first_bad >= fw.MIN_HEALTHY_STEPS, "the run must stay healthy long enough for a warning to mean something"


def test_runaway_is_warned_early_stopped_and_logged_to_tensorboard_and_wandb(
    fw, tmp_path, wandb_env, unmonitored_runaway, caplog
):
    import wandb
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, first_bad = unmonitored_runaway
    memory = MemorySink()
    cb = fw.callback([memory])
    with caplog.at_level(logging.WARNING, logger="nummon"):
        run = fw.runaway(tmp_path, cb, loggers=True)
    wandb.finish()
    wandb.teardown()  # the W&B singleton keeps this test's directories otherwise

    assert warnings_of(cb), "no warning at all"
    assert min(a.step for a in warnings_of(cb)) <= first_bad - 3, (warnings_of(cb), first_bad)
    # stopped by the callback at the critical alert, before the loss was lost and before max_steps
    critical = [a for a in cb.monitor.alerts if a.severity is Severity.CRITICAL]
    assert critical and cb.stopped_at == critical[0].step
    assert run.trainer_steps == cb.stopped_at + 1 < fw.RUNAWAY_STEPS
    assert cb.stopped_at <= first_bad - fw.STOP_MARGIN, (cb.stopped_at, first_bad)
    assert all(math.isfinite(v) for v in run.losses.values())
    # the loss nummon saw is each step's own loss, for every step the framework ran
    assert sorted(run.losses) == [r.step for r in memory.records]
    for rec in memory.records:
        assert rec.loss == pytest.approx(run.losses[rec.step], rel=1e-5)
    # the stop line names the incident
    stop = [r.getMessage() for r in caplog.records if "stopping training" in r.getMessage()]
    assert stop and "incident 1, run critical" in stop[0], stop

    # the event log and flight record in the framework's run folder
    assert os.path.isfile(os.path.join(run.events_dir, "nummon-events.jsonl"))
    assert cb.monitor.flight_record is not None and Path(cb.monitor.flight_record).parent == Path(run.events_dir)

    # nummon's scalars and alerts in the framework's own TensorBoard run folder
    acc = EventAccumulator(str(run.tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    for tag in ("nummon/loss", "nummon/grad_norm", "nummon/activation_max", "nummon/health", *fw.TB_TAGS):
        assert tag in scalars, tag
    assert {e.step for e in acc.Scalars("nummon/loss")} == {r.step for r in memory.records}
    assert any(t.startswith("nummon_2_alerts/") for t in acc.Tags()["tensors"])
    # the incident state at each step, as the incident events say (the state after that step's report)
    tb_state = {e.step: e.value for e in acc.Scalars("nummon/incident_state")}
    assert tb_state == expected_series(memory.incidents, [r.step for r in memory.records])

    # the alerts in the offline W&B run file the framework's logger opened
    records = read_records(find_run_file(run.wandb_root))
    titles, logged_steps = nummon_alert_titles_and_steps(records)
    assert any(t.startswith("nummon:") for t in titles), titles
    # and every step's scalars, charted against nummon/step (the framework logs without step=)
    assert logged_steps == [r.step for r in memory.records]


def test_healthy_run_gets_no_warning(fw, tmp_path):
    memory = MemorySink()
    cb = fw.callback([memory])
    run = fw.healthy(tmp_path, cb)
    assert run.trainer_steps == fw.HEALTHY_STEPS and cb.stopped_at is None
    assert len(memory.records) == fw.HEALTHY_STEPS
    assert warnings_of(cb) == []


def test_accumulation_and_clipping_report_the_unclipped_norm_and_step_loss(fw, tmp_path):
    """4 micro-batches per step, clipping active on every step: nummon's grad_norm is the norm
    clip_grad_norm_ returns (before clipping), its loss the step's mean micro-batch loss."""
    memory = MemorySink()
    cb = fw.callback([memory])
    run = fw.accumulated_and_clipped(tmp_path, cb)
    assert run.trainer_steps == 6 and len(memory.records) == 6
    assert sorted(run.grad_norms) == sorted(run.losses) == [r.step for r in memory.records]
    assert min(run.grad_norms.values()) > fw.CLIP  # clipping really scaled every step down
    for rec in memory.records:
        assert rec.grad_norm == pytest.approx(run.grad_norms[rec.step], rel=1e-5), rec.step
        assert rec.loss == pytest.approx(run.losses[rec.step], rel=1e-5), rec.step
    assert cb.last_clip_ratio == pytest.approx(fw.CLIP / run.grad_norms[memory.records[-1].step], rel=1e-5)


def test_planted_log_of_zero_is_explained_in_the_critical_alert(fw, tmp_path):
    cb = fw.callback()
    planted = fw.planted_log_of_zero(tmp_path, cb)
    src, first = inspect.getsourcelines(planted)
    line = first + next(i for i, text in enumerate(src) if "LOG_OF_ZERO_LINE" in text)
    crit = [a for a in cb.monitor.alerts if a.severity is Severity.CRITICAL and a.kind.value == "nonfinite"]
    assert crit and crit[0].step == 30 and cb.stopped_at == 30
    assert "log_of_zero" in crit[0].message and f"{fw.NAME}_runs.py:{line}" in crit[0].message
    assert crit[0].details["cause"]["op"] == "aten::log"


def incident_lines(lines):
    return [(step, text) for step, text in lines if str(text).startswith("nummon: run ")]


def test_the_readme_example_driven_to_blow_up_prints_incident_lines_before_the_first_nonfinite_step(fw, tmp_path):
    memory = MemorySink()
    # (the default cadence: a run's first records, and any whose values rise out of their quiet
    # bands, have the activations measured at the next step too, so the activation maximum's
    # runaway is seen as early as with activations every step)
    cb = fw.callback([memory], stop_on_critical=False, console=True)
    lines = fw.readme_blow_up(tmp_path, cb)
    first_bad = next(r.step for r in memory.records if not r.is_finite())
    incidents = incident_lines(lines)
    assert incidents and incidents[0][0] < first_bad, (incidents, first_bad)
    # each incident line is printed by the end of the step it names (before the framework logs that step)
    for step, text in incidents:
        assert step is not None and step <= int(re.search(r"at step (\d+)", text).group(1)), (text, lines)
    # one line per incident event, plain text (no Markdown marks)
    assert len(incidents) == len([e for e in cb.monitor.incidents if e.state.rank >= 1])
    assert not any("**" in str(text) or "`" in str(text) for _, text in lines)
    # the countdown of the first critical alert does not promise steps that were not there
    crit = next(a for a in cb.monitor.alerts if a.severity is Severity.CRITICAL)
    left = first_bad - crit.step
    assert 1 <= crit.details["steps_to_overflow"] <= 1.5 * left + 2, (crit.message, left)
    assert "at most" in crit.message or "keeps speeding up" in crit.message  # the faster reading is said


def test_console_false_keeps_the_callback_quiet(fw, tmp_path):
    lines = fw.readme_blow_up(tmp_path, fw.callback([MemorySink()], stop_on_critical=False, console=False))
    assert not incident_lines(lines)
    assert not [text for _, text in lines if "watching" in str(text)]  # no start line, no summary


def _claimed_count(number, unit):
    return float(number) * {"": 1, "k": 1e3, "M": 1e6, "B": 1e9}[unit]


START = re.compile(
    r"nummon: watching (\w+) \(([\d.]+)([kMB]?) trainable parameters in (\d+) tensors\), policy (\w+) "
    r"\(stop on critical: (yes|no)\); gradients every step, parameters every (\d+) and optimizer state "
    r"every (\d+) steps, activations (every \d+ steps|off); events in (.+), flight records in (.+)$"
)
SUMMARY = re.compile(
    r"nummon: finished watching (\d+) steps?: (?:no incident|(\d+) incidents?, worst state (\w+); the worst "
    r"moment: step (\d+), (.+?); incident (\d+) (?:ended at step (\d+)|still open at the end)); events in (.+?)"
    r"(?:, flight record (.+))?$"
)


def test_the_callback_says_what_it_watches_and_ends_with_a_summary(fw, tmp_path):
    """One line at the start (what is watched, the policy, the sampling, where
    the files go) and one at the end (steps, incidents, the worst state and moment, the files),
    every number in them checked against the run."""
    memory = MemorySink()
    cb = fw.callback([memory], stop_on_critical=False, console=True)
    texts = [str(text) for _, text in fw.readme_blow_up(tmp_path, cb)]
    start, end = START.match(texts[0]), SUMMARY.match(texts[-1])
    assert start and end, (texts[0], texts[-1])
    model, policy = cb.monitor._stats.model, cb.policy
    params = list(model.parameters())
    name, number, unit, tensors, preset, stop, params_every, optim_every, acts, events, flight_dir = start.groups()
    assert name == type(model).__name__ and int(tensors) == len(params)
    assert _claimed_count(number, unit) == pytest.approx(sum(p.numel() for p in params), rel=5e-3)
    assert (preset, stop, int(params_every), int(optim_every), acts) == (
        policy.name,
        "no",
        policy.sampling.params_every,
        policy.sampling.optimizer_every,
        f"every {policy.sampling.activations_every} steps",
    )
    assert Path(events).is_file() and Path(flight_dir).is_dir()

    steps, count, worst_state, worst_step, what, last_number, ended_at, events_again, flight = end.groups()
    opened = [e for e in cb.monitor.incidents if e.state.rank >= 1]
    worst = max(e.state.rank for e in opened)
    assert int(steps) == len(memory.records)
    assert int(count) == len({e.number for e in opened}) >= 1
    assert worst_state == next(e.state.value for e in opened if e.state.rank == worst)
    assert int(worst_step) == min(e.step for e in opened if e.state.rank == worst)
    last = cb.monitor.incidents[-1]
    assert int(last_number) == last.number
    assert (ended_at is not None) == (last.state.value == "resolved")
    assert ended_at is None or int(ended_at) == last.step
    assert what.startswith("run ") and not any("`" in t or "**" in t for t in (texts[0], texts[-1]))  # plain text
    assert events_again == events and Path(flight).is_file() and Path(flight).parent == Path(flight_dir)


def test_a_healthy_run_sums_up_with_no_incident(fw, tmp_path, caplog):
    cb = fw.callback([MemorySink()])
    with caplog.at_level(logging.WARNING, logger="nummon"):
        run = fw.healthy(tmp_path, cb)
    texts = [r.getMessage() for r in caplog.records if r.name == "nummon"]
    assert len(texts) == 2 and START.match(texts[0]), texts
    assert texts[1].startswith(f"nummon: finished watching {run.trainer_steps} steps: no incident; events in "), texts


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_missing_framework_gives_an_install_hint(name, tmp_path):
    # a stub package that fails to import stands in for an environment without the framework
    extra = {"lightning": "lightning", "transformers": "transformers"}[name]
    stub = tmp_path / name
    stub.mkdir()
    (stub / "__init__.py").write_text(f"raise ImportError('No module named {name}')\n")
    proc = subprocess.run(
        [sys.executable, "-c", f"import nummon.integrations.{name}"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert proc.returncode != 0
    assert f"pip install 'nummon[{extra}]'" in proc.stderr.strip().splitlines()[-1]
