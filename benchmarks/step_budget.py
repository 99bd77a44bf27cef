"""The host work of one monitored step, by stage: counts (deterministic) and µs (noisy).

Stages: `forward_hooks` (activation probes' forward hooks), `probes` (the mechanism probes: their
forward pre-hook, capture, take, decode, arming), `end_of_backward` (the pre-clip capture's
gradient hook and end-of-backward callback), `launch` (the step's reductions and the packing),
`read_decode` (the one host read and the record), `detectors` (HealthEngine.step), `dispatch`
(the sinks), `post_step` (the Monitor's own Python around them), `other` (nummon code reached
outside those: a hook of a new kind).

Counts mode (default) runs each model under `sys.setprofile` and a `TorchDispatchMode` and
counts, per step and stage, Python function calls (by nummon module), torch (aten) ops and host
reads (`tolist`, `item`, `_local_scalar_dense`). Counts are exact and repeatable on a loaded
machine, and work on any checkout (stages are found by module and function name). Steps are
`ordinary` (no parameter / optimizer-state / mechanism sample, no activation hooks, none
registered for the next forward), `quiet` (an ordinary step whose record the engine's fast path
took: provably quiet, it skipped the detectors; `nummon/_engine/quiet.py`) or `sampled`.

    python benchmarks/step_budget.py [--models cnn,lm12,tiny-1000] [--steps 40] [--times] [--json out.json]

`--times` also measures µs per stage with timers around each stage's entry points (no
profiler): under load these are indicative only.
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# the checkout's own package first: a benchmark measures the code beside it (an editable install
# of another checkout, or an older installed version, would otherwise answer `import nummon`)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nummon  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from overhead_scale import workload  # noqa: E402

STAGES = (
    "forward_hooks",
    "probes",
    "end_of_backward",
    "launch",
    "read_decode",
    "detectors",
    "dispatch",
    "post_step",
    "other",
)
#: (file suffix, function name) -> the stage it starts ("*": any function of that file)
ENTRIES = {
    ("_stats/collector.py", "launch"): "launch",
    ("_stats/collector.py", "resolve"): "read_decode",
    ("nummon/_engine/engine.py", "step"): "detectors",
    ("nummon/_sinks/dispatch.py", "*"): "dispatch",
    ("_stats/mechanisms.py", "*"): "probes",
    ("_stats/capture.py", "*"): "probes",
    ("_stats/capture_maths.py", "*"): "probes",
    ("_stats/capture_plan.py", "*"): "probes",
    ("_stats/adam_stats.py", "*"): "probes",
    ("_stats/preclip.py", "*"): "end_of_backward",
    ("nummon/_monitor/monitor.py", "post_step"): "post_step",
    ("_stats/probes.py", "hook"): "forward_hooks",
}
HOST_READS = {"tolist", "numpy", "cpu", "synchronize"}  # item(), float(t): the aten op
#: nummon's own source folders: the package and its integrations (a checkout keeps integrations/ beside
#: nummon/). Matched by folder, not by a "/nummon/" in the path: a clone named nummon holds its .venv, torch
#: included, under ".../nummon/.venv/...".
_PACKAGE_DIRS = {
    os.path.dirname(os.path.abspath(str(m.__file__))) + os.sep: prefix
    for m, prefix in ((nummon, ""), (importlib.import_module("nummon.integrations"), "integrations/"))
}


def _nummon_part(filename: str) -> str | None:
    """`filename` inside nummon's sources ("_stats/probes.py", "integrations/wandb.py"), or None outside them."""
    for folder, prefix in _PACKAGE_DIRS.items():
        if filename.startswith(folder):
            return prefix + filename[len(folder) :].replace(os.sep, "/")
    return None


#: nummon's files that are the training loop's, not the monitor's (the demo's model)
USER_CODE = ("nummon/_tools/demo_model.py",)


def _entry_stage(code: Any) -> str | None:
    fn = code.co_filename.replace(os.sep, "/")
    for (suffix, name), stage in ENTRIES.items():
        if fn.endswith(suffix) and (name == "*" or code.co_name == name):
            return stage
    # any other nummon code the training loop reaches (a new hook): counted, never unseen
    return "other" if _nummon_part(code.co_filename) is not None and not fn.endswith(USER_CODE) else None


class StepCounter(TorchDispatchMode):
    """Counts Python calls, C calls, aten ops and host reads per stage while installed."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[Any, str]] = []  # (frame, stage) of the stage entries on the stack
        # the ops pass: aten ops only (the mode's own Python per op is not the step's)
        self.ops_pass = False
        self._entry_cache: dict[Any, str | None] = {}
        self.reset()

    def reset(self) -> None:
        self.calls: collections.Counter = collections.Counter()  # stage -> Python calls
        self.calls_by_module: collections.Counter = collections.Counter()  # (stage, module) -> calls
        self.ops: collections.Counter = collections.Counter()  # stage -> aten ops
        self.ops_by_name: collections.Counter = collections.Counter()
        self.reads: collections.Counter = collections.Counter()  # stage -> host reads

    @property
    def stage(self) -> str | None:
        return self.stack[-1][1] if self.stack else None

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_filename == __file__:
                return
            st = self._entry_cache.get(code, "?")
            if st == "?":
                st = self._entry_cache[code] = _entry_stage(code)
            if st is not None and st != self.stage and not (self.stage and st in ("post_step", "other")):
                self.stack.append((frame, st))
            stage = self.stage
            if stage is not None and not self.ops_pass:
                self.calls[stage] += 1
                part = _nummon_part(code.co_filename)
                mod = f"{part if part is not None else code.co_filename.rsplit(os.sep, 2)[-1]}:{code.co_name}"
                self.calls_by_module[(stage, mod)] += 1
        elif event == "return":
            if self.stack and self.stack[-1][0] is frame:
                self.stack.pop()
        elif event == "c_call":
            if self.stack and not self.ops_pass and getattr(arg, "__name__", "") in HOST_READS:
                self.reads[self.stage] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stage = self.stage
        if stage is not None:
            self.ops[stage] += 1
            self.ops_by_name[(stage, func)] += 1
            if func is torch.ops.aten._local_scalar_dense.default:  # item(), float(t), bool(t)
                self.reads[stage] += 1
        return func(*args, **(kwargs or {}))


def _sampled(mon: Any, step: int) -> bool:
    """Whether `step` does more than an ordinary step (a cadence or a probe sample is due, its
    forward measures the activations, or the full activation hooks are on)."""
    sp = mon._policy.sampling
    mech = getattr(mon._stats, "mechanisms", None)
    probes = getattr(mon._stats, "probes", None)
    return (
        step % sp.params_every == 0
        or step % sp.optimizer_every == 0
        or bool(mech is not None and getattr(mech, "armed", False))
        or bool(probes is not None and getattr(probes, "detail", False) and getattr(probes, "_always", None))
        or _arms_activations(mon)
    )


def _quiet_taken(mon: Any) -> int:
    """Records the engine's fast path holds (checkouts with one: `engine._quiet.booked`); one
    more after a step: its record was provably quiet and skipped the detectors."""
    quiet = getattr(getattr(getattr(mon, "_steps", None), "engine", None), "_quiet", None)
    return len(quiet.booked) if quiet is not None else 0


def _arms_activations(mon: Any) -> bool:
    """Whether the activation hooks are registered for the next forward (checkouts that hook on a
    cadence: `probes.measuring`). Before a step: its forward measures; after it: the step
    registered them at its end (their cost is the sample's, so that step counts as sampled)."""
    probes = getattr(mon._stats, "probes", None)
    return bool(probes is not None and getattr(probes, "measuring", False) and getattr(probes, "_modules", None))


def count_steps(name: str, steps: int, warmup: int = 3) -> dict[str, Any]:
    """Per ordinary and per sampled step of workload `name` (overhead_scale's): see `count_workload`."""

    def make() -> tuple[Any, Any, Any]:
        model, make_opt, loss_fn = workload(name, torch.device("cpu"))
        return model, make_opt(model), loss_fn

    return count_workload(make, steps, warmup)


def count_workload(make: Any, steps: int, warmup: int = 3, policy: Any = "default") -> dict[str, Any]:
    """Per ordinary and per sampled step: Python calls and host reads (a run under the
    profiler), aten ops (a second, identical run under the dispatch mode too). `make()` returns
    a fresh (model, optimizer, loss_fn(model)), the same each time."""
    calls = _count_run(make, steps, warmup, policy, ops_pass=False)
    ops = _count_run(make, steps, warmup, policy, ops_pass=True)
    for kind, c in calls.items():
        for field in ("ops", "ops_max", "ops_by_name", "ops_total"):
            c[field] = ops[kind][field]
        for field in ("reads", "reads_max"):  # item() / float(t): seen as aten ops only
            for stage, n in ops[kind][field].items():
                c[field][stage] = c[field].get(stage, 0) + n
        c["reads_total"] = sum(c["reads"].values())
    return calls


def _count_run(make: Any, steps: int, warmup: int, policy: Any, ops_pass: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model, opt, loss_fn = make()
    mon = nummon.Monitor(model, opt, policy=policy)
    counter = StepCounter()
    counter.ops_pass = ops_pass
    per: dict[str, list[dict[str, Any]]] = {"ordinary": [], "quiet": [], "sampled": []}
    # no collection inside a counted step: it runs the finalizers of whatever an earlier test or
    # model left (a closed Monitor's), counted as calls of the stage it interrupted
    gc.collect()
    gc.disable()
    try:
        _count_steps(mon, model, opt, loss_fn, counter, warmup, steps, ops_pass, per)
    finally:
        gc.enable()
    mon.close()
    return {kind: _median_counts(rows) for kind, rows in per.items() if rows}


def _count_steps(
    mon: Any, model: Any, opt: Any, loss_fn: Any, counter: Any, warmup: int, steps: int, ops_pass: bool, per: dict
) -> None:
    for i in range(warmup + steps):
        kind = "sampled" if _sampled(mon, mon.step) else "ordinary"
        taken = _quiet_taken(mon)
        counter.reset()
        measured = i >= warmup
        if measured:
            sys.setprofile(counter.profile)
            if ops_pass:
                counter.__enter__()
        try:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model)
            loss.backward()
            opt.step()
            mon.post_step(loss)
        finally:
            if measured:
                sys.setprofile(None)
                if ops_pass:
                    counter.__exit__(None, None, None)
        if _arms_activations(mon):  # this step registered the next forward's activation hooks
            kind = "sampled"
        elif kind == "ordinary" and _quiet_taken(mon) > taken:  # its record skipped the detectors
            kind = "quiet"
        if measured:
            per[kind].append(
                {
                    "calls": dict(counter.calls),
                    "ops": dict(counter.ops),
                    "reads": dict(counter.reads),
                    "calls_by_module": {f"{s}:{m}": n for (s, m), n in counter.calls_by_module.items()},
                    "ops_by_name": {f"{s}:{o}": n for (s, o), n in counter.ops_by_name.items()},
                }
            )


def _median_counts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": len(rows)}
    for field in ("calls", "ops", "reads", "calls_by_module", "ops_by_name"):
        keys = sorted({k for r in rows for k in r[field]})
        out[field] = {k: statistics.median(r[field].get(k, 0) for r in rows) for k in keys}
        if field in ("calls", "ops", "reads"):  # budgets hold on every step, not only the median one
            out[f"{field}_max"] = {k: max(r[field].get(k, 0) for r in rows) for k in keys}
    for field in ("calls", "ops", "reads"):
        out[f"{field}_total"] = sum(out[field].values())
    return out


# ---------------------------------------------------------------- µs per stage (no profiler)


#: the stage timers' clock (--cpu-time: this thread's CPU time, less disturbed by other processes)
CLOCK = [time.perf_counter]


class StageTimer:
    """Exclusive wall time per stage, from wrappers around each stage's entry points."""

    def __init__(self) -> None:
        self.us: collections.Counter = collections.Counter()
        self._stack: list[list[float]] = []  # [start, time in nested stages]

    def wrap(self, fn: Any, stage: str) -> Any:
        if getattr(fn, "_budget_stage", None):
            return fn
        clock = CLOCK[0]

        def timed(*a: Any, **k: Any) -> Any:
            frame = [clock(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*a, **k)
            finally:
                self._stack.pop()
                total = clock() - frame[0]
                self.us[stage] += (total - frame[1]) * 1e6
                if self._stack:
                    self._stack[-1][1] += total

        timed._budget_stage = stage  # type: ignore[attr-defined]
        return timed


def _wrap_methods(timer: StageTimer, mon: Any) -> None:
    """Time the post_step stages through instance attributes (bound methods looked up per call)."""
    stats = mon._stats
    for obj, attr, stage in (
        (mon, "_post_step", "post_step"),
        (stats, "launch", "launch"),
        (stats, "resolve", "read_decode"),
        (mon._steps.engine, "step", "detectors"),
        (mon._sinks, "step", "dispatch"),
        (mon._sinks, "alert", "dispatch"),
        (mon._sinks, "incident", "dispatch"),
        (getattr(stats, "mechanisms", None), "take", "probes"),
        (getattr(stats, "mechanisms", None), "decode", "probes"),
        (getattr(stats, "mechanisms", None), "arm", "probes"),
        (getattr(stats, "preclip", None), "_end_of_backward", "end_of_backward"),
    ):
        if obj is not None and hasattr(obj, attr):
            setattr(obj, attr, timer.wrap(getattr(obj, attr), stage))


def _wrap_hooks(timer: StageTimer, model: torch.nn.Module) -> None:
    """Time every module hook nummon registered (re-run before each step: hooks come and go)."""
    for m in model.modules():
        for hooks in (m._forward_hooks, m._forward_pre_hooks):
            for k, h in list(hooks.items()):
                owner = getattr(getattr(h, "func", h), "__module__", "") or ""
                if owner.startswith("nummon"):
                    stage = "forward_hooks" if owner.endswith("probes") else "probes"
                    hooks[k] = timer.wrap(h, stage)
    for p in model.parameters():
        hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
        for k, h in list(hooks.items()):
            if (getattr(h, "__module__", "") or "").startswith("nummon"):
                hooks[k] = timer.wrap(h, "end_of_backward")


def time_steps(name: str, steps: int, warmup: int = 3) -> dict[str, Any]:
    """µs per ordinary and per sampled step by stage (medians; exclusive of nested stages)."""
    torch.manual_seed(0)
    model, make_opt, loss_fn = workload(name, torch.device("cpu"))
    opt = make_opt(model)
    mon = nummon.Monitor(model, opt, policy="default")
    timer = StageTimer()
    _wrap_methods(timer, mon)
    per: dict[str, list[dict[str, float]]] = {"ordinary": [], "quiet": [], "sampled": []}
    for i in range(warmup + steps):
        kind = "sampled" if _sampled(mon, mon.step) else "ordinary"
        taken = _quiet_taken(mon)
        _wrap_hooks(timer, model)
        timer.us.clear()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model)
        loss.backward()
        opt.step()
        mon.post_step(loss)
        if _arms_activations(mon):  # this step registered the next forward's activation hooks
            kind = "sampled"
        elif kind == "ordinary" and _quiet_taken(mon) > taken:  # its record skipped the detectors
            kind = "quiet"
        if i >= warmup:
            per[kind].append(dict(timer.us))
    mon.close()
    return {
        kind: {s: round(statistics.median(r.get(s, 0.0) for r in rows), 1) for s in STAGES}
        for kind, rows in per.items()
        if rows
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="cnn,lm12,tiny-1000")
    ap.add_argument("--steps", type=int, default=40, help="measured steps per model (after 3 warm-up steps)")
    ap.add_argument("--times", action="store_true", help="also µs per stage (wall time: noisy under load)")
    ap.add_argument("--cpu-time", action="store_true", help="time stages in this thread's CPU time")
    ap.add_argument("--detail", action="store_true", help="calls by module and ops by name")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # every stage's work on this thread (and its CPU time)
    if a.cpu_time:
        CLOCK[0] = time.thread_time
    res: dict[str, Any] = {}
    for name in a.models.split(","):
        res[name] = {"counts": count_steps(name, a.steps)}
        if a.times:
            res[name]["us"] = time_steps(name, a.steps)
        for kind, c in res[name]["counts"].items():
            print(
                f"{name:10s} {kind:8s} ({c['steps']} steps): python calls {c['calls_total']:.0f}, "
                f"aten ops {c['ops_total']:.0f}, host reads {c['reads_total']:.0f}"
            )
            for s in STAGES:
                if s in c["calls"] or s in c["ops"]:
                    us = res[name].get("us", {}).get(kind, {}).get(s)
                    print(
                        f"    {s:16s} calls {c['calls'].get(s, 0):6.0f}  ops {c['ops'].get(s, 0):5.0f}  "
                        f"reads {c['reads'].get(s, 0):2.0f}" + (f"  {us:8.1f} us" if us is not None else "")
                    )
            if a.detail:
                for k, n in sorted(c["calls_by_module"].items(), key=lambda kv: -kv[1])[:25]:
                    print(f"      {k:50s} {n:6.0f}")
                for k, n in sorted(c["ops_by_name"].items(), key=lambda kv: -kv[1])[:15]:
                    print(f"      {k:50s} {n:6.0f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
