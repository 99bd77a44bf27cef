"""Real gloo process groups on CPU: DDP, FSDP2, identical decisions, one collective per step."""

import json

import pytest
from helpers import dist_workers as W
from helpers.ranks import free_port, start_ranks

# gloo process groups from a fork server (about 5 s to start per xdist worker): the full suite's
pytestmark = pytest.mark.slow


def spawn(fn, world, tmp_path, *extra):
    start_ranks(fn, world, (world, free_port(), str(tmp_path), *extra))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_nan_on_rank1_same_alert_everywhere_naming_rank1(world, tmp_path):
    res = spawn(W.ddp_nan_on_one_rank, world, tmp_path)
    decisions = [[(a["step"], a["kind"], a["severity"]) for a in r["alerts"]] for r in res]
    assert all(d == decisions[0] for d in decisions), decisions
    nf = [a for a in res[0]["alerts"] if a["kind"] == "nonfinite"]
    assert nf and nf[0]["step"] == 5 and nf[0]["severity"] == "critical"
    assert nf[0]["rank"] == 1 and "rank 1" in nf[0]["message"] and "fc2" in nf[0]["message"]
    assert {r["stopped_at"] for r in res} == {5}
    assert all(set(r["collectives"]) == {1} for r in res)  # exactly one collective per step
    assert res[0]["sink_records"] == 6 and res[0]["sink_alerts"] > 0
    assert all(r["sink_records"] == 0 and r["sink_alerts"] == 0 for r in res[1:])  # rank 0 only
    assert (tmp_path / "events-rank0.jsonl").exists() and not (tmp_path / "events-rank1.jsonl").exists()


def test_finite_runaway_on_one_rank_is_alerted_on_all(tmp_path):
    res = spawn(W.runaway_on_one_rank, 2, tmp_path)
    assert res[0]["alerts"] == res[1]["alerts"]
    kinds = {k for _, k, s in res[0]["alerts"] if s in ("warning", "critical")}
    assert kinds & {"explosion", "runaway", "loss_spike"}


def test_fsdp2_grad_norm_equals_single_process(tmp_path):
    res = spawn(W.fsdp2_grad_norm, 2, tmp_path)
    for r in res:
        for got, want in zip(r["got"], r["want"]):
            assert got == pytest.approx(want, rel=1e-5)
        for got, want in zip(r["pnorm"], r["ref_pnorm"]):
            assert got == pytest.approx(want, rel=1e-5)
        assert r["collectives"] == 3


def test_a_dead_rank_does_not_hang_the_monitor(tmp_path):
    res = spawn(W.dead_rank, 2, tmp_path)
    assert res[0]["error"] and "DistributedError" in res[0]["error"]
    assert "gathering step statistics across 2 ranks failed on rank 0" in res[0]["error"]
    assert "group timeout 5 s" in res[0]["error"]  # the group's own timeout, not the 1800 s default


@pytest.mark.parametrize(
    "variant, what", [("x_only", "a batch of 1 tensor(s) on rank 1"), ("none", "no batch on rank 1")]
)
def test_ranks_passing_different_batches_get_a_distributed_error(variant, what, tmp_path):
    res = spawn(W.mismatched_batches, 2, tmp_path, variant)
    for r in res:  # every rank sees every header: every rank raises the same error
        assert r["error"].startswith("DistributedError: nummon: rank 1 passed different statistics"), r["error"]
        assert what in r["error"] and "a batch of 2 tensor(s) on rank 0" in r["error"]


def test_ranks_with_different_parameter_sets_get_a_distributed_error_naming_the_rank(tmp_path):
    # rank 1's model has one Linear more: its statistics are longer; the gather's size is agreed
    # first, so the header check names the rank instead of gloo aborting rank 0 ("data size")
    res = spawn(W.different_parameter_sets, 2, tmp_path)
    for r in res:
        assert r["error"] and r["error"].startswith("DistributedError: nummon: rank 1 passed different statistics"), r


def test_a_rank_in_a_barrier_fails_post_step_within_the_monitor_timeout(tmp_path):
    res = spawn(W.one_rank_in_a_barrier, 2, tmp_path)
    assert res[0]["error"].startswith("DistributedError"), res[0]["error"]
    assert "nummon timeout 3 s, group timeout 20 s" in res[0]["error"]


def test_fsdp1_flat_params_grad_norm_equals_single_process(tmp_path):
    res = spawn(W.fsdp1_grad_norm, 2, tmp_path)
    for r in res:
        for got, want in zip(r["got"], r["want"]):
            assert got == pytest.approx(want, rel=1e-5)


def test_finite_but_extreme_is_not_taken_for_nonfinite_across_ranks(tmp_path):
    """float32 sums of squares overflow above ~1e19; the combined norms are recomputed exactly."""
    res = spawn(W.ddp_finite_but_extreme, 2, tmp_path)
    for r in res:
        assert r["ref"]["param_norm"] > 1e20 and r["ref"]["grad_norm"] > 1e19  # float32 squares overflow
        for rec in r["records"]:
            assert rec["health"] != "nonfinite"
            assert rec["param_norm"] == pytest.approx(r["ref"]["param_norm"], rel=1e-6)
            assert rec["grad_norm"] == pytest.approx(r["ref"]["grad_norm"], rel=1e-5)
        assert not any(kind == "nonfinite" for kind, _ in r["alerts"])
    assert res[0]["alerts"] == res[1]["alerts"]


def test_a_compiled_ddp_model_gets_its_forward_probes_from_a_replay_that_joins_no_collective(tmp_path):
    res = spawn(W.compiled_ddp_mechanisms, 2, tmp_path)
    for r in res:
        assert r["errors"] == 0 and r["collectives"] == [1, 1, 1, 1]  # one gather per step, as in eager
        sampled = [rec for rec in r["records"] if rec["step"] % 2 == 0]
        assert len(sampled) == 2 and all(rec["layer_output_rms"] for rec in sampled)
        assert all(rec["output_logsumexp_mean"] is not None for rec in sampled)  # the loss outside read its output
    assert res[0]["weights"] == res[1]["weights"]  # still one model


@pytest.mark.parametrize(
    "variant, fault_step, suspects, family",
    [("nudge", 7, [1], "parameters"), ("grad", 10, [1], "gradients"), ("bitflip", 12, [2], "parameters")],
)
def test_a_replica_fault_on_one_rank_is_named_within_the_cadence_on_every_rank(
    variant, fault_step, suspects, family, tmp_path
):
    every = 5
    res = spawn(W.replica_faults, 3, tmp_path, variant, 40, every, fault_step)
    assert all(r["alerts"] == res[0]["alerts"] for r in res)  # the same decision on every rank
    first = res[0]["alerts"][0]
    assert first["kind"] == "replica_mismatch" and first["severity"] == "critical"
    assert fault_step <= first["step"] < fault_step + every
    assert first["details"]["suspect_ranks"] == suspects and family in first["details"]["families"]
    others = ", ".join(str(r) for r in range(3) if r not in suspects)
    assert f"rank {suspects[0]}'s {family} differ from those of ranks {others}" in first["message"]
    assert {r["stopped_at"] for r in res} == {first["step"]}  # critical: every rank stops at that step


def test_two_ranks_that_differ_are_said_to_disagree(tmp_path):
    res = spawn(W.replica_faults, 2, tmp_path, "nudge", 20, 5, 7)
    first = res[0]["alerts"][0]
    assert res[0]["alerts"] == res[1]["alerts"] and first["details"]["suspect_ranks"] == [0, 1]
    assert "ranks 0 and 1 disagree on their parameters" in first["message"]


def test_a_healthy_three_rank_run_has_no_replica_mismatch(tmp_path):
    res = spawn(W.replica_faults, 3, tmp_path, "healthy", 300, 5, -1)
    for r in res:
        assert r["alerts"] == [] and r["stopped_at"] is None and r["checks"] == 60
