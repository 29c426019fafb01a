"""Running a study: every run as a ``remoe train`` child process, resumable, ``jobs`` at once.

State lives in the run directories, not in the study process: a run whose ``summary.json``
exists is done (never redone) once, if the spec has ``eval: {tasks: ...}``, its
``eval_results.json`` holds those tasks too (a trained run without them gets a ``remoe eval``
child of its own); a run with a checkpoint is continued with ``--resume``; any
other run starts from scratch. So a study killed at any point (``kill -9`` of the study and/or
its children) continues where it stopped when started again. Children get ``SIGTERM`` when the
study process dies (``PR_SET_PDEATHSIG`` on Linux), so no orphan keeps writing into a run that
the next study would resume; ``<out>/study.lock`` (``flock``) keeps two studies off one
directory. Ctrl-C interrupts the children (SIGINT, then SIGKILL after a grace period); their
last checkpoints stay.

``<out>/study.json`` records each run's state (pending / running / done / failed / skipped /
interrupted), exit status, attempts and wall time; it is rewritten atomically at every change.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from remoe.errors import ConfigError
from remoe.experiment import load_config
from remoe.lab.analysis.runlog import Run, run_has, run_json
from remoe.lab.study.archive import committed_dir, export_run, up_to_date
from remoe.fileio import atomic_write_text
from remoe.lab.study.runs import (RunSpec, RunState, add_wall, adopt_identical, apply_stop,
                                  config_diff, default_command, die_with_parent, eval_command,
                                  eval_done, finished_runs, last_write, read_json, same_experiment,
                                  tail)
from remoe.lab.study.spec import StudySpec

STATE_FILE = "study.json"
GRACE_S = 30.0  # Ctrl-C: seconds children get to exit before SIGKILL
def cores() -> int:
    return len(os.sched_getaffinity(0))


def threads_per_job(jobs: int) -> int:
    return max(1, cores() // max(1, jobs))


@dataclass
class Study:
    """A spec bound to an output directory."""

    spec: StudySpec
    out: Path
    jobs: int = 1
    command: Callable[[Path, list[str]], list[str]] = default_command
    evaluate: Callable[[Path, str, int | None, bool], list[str]] = eval_command
    log: Callable[[str], None] = print
    only: set[str] | None = None  # run names to run (dependencies are added)
    reuse: tuple[Path, ...] = ()  # other study directories whose identical finished runs count
    states: dict[str, RunState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.threads = threads_per_job(self.jobs)
        old = read_json(self.out / STATE_FILE) or {}
        for r in self.spec.runs:
            prev = (old.get("runs") or {}).get(r.name) or {}
            st = RunState()
            for k in ("attempts", "exit_status", "wall_s", "total_wall_s", "started", "finished",
                      "state", "message", "eval_wall_s", "phase"):
                if k in prev:
                    setattr(st, k, prev[k])
            self.states[r.name] = st

    # -- paths ------------------------------------------------------------------------------
    @property
    def runs_dir(self) -> Path:
        return (self.out / "runs").resolve()

    def run_dir(self, r: RunSpec) -> Path:
        return self.runs_dir / r.name

    def config_path(self, r: RunSpec) -> Path:
        return self.out / "configs" / f"{r.name}.yaml"

    def log_path(self, r: RunSpec) -> Path:
        return self.out / "logs" / f"{r.name}.log"

    # -- what a run's directory says ----------------------------------------------------------
    def committed(self, r: RunSpec) -> Path | None:
        """The run's committed copy (spec ``results:``, remoe.lab.study.archive) when its own
        directory holds no finished run: a run committed once is never trained again (delete
        the copy to rerun it)."""
        if (self.run_dir(r) / "summary.json").is_file():
            return None
        return committed_dir(self.spec.results_dir, r.name)

    def source_dir(self, r: RunSpec) -> Path:
        """Where the run's outputs are read from: its directory, else its committed copy."""
        return self.committed(r) or self.run_dir(r)

    def summary(self, r: RunSpec) -> dict[str, Any] | None:
        return run_json(self.source_dir(r), "summary.json")

    def trained(self, r: RunSpec) -> bool:
        return self.summary(r) is not None

    def done(self, r: RunSpec) -> bool:
        """Trained and, if the spec asks for zero-shot tasks, evaluated on them (a committed
        copy is done: only finished, evaluated runs are committed)."""
        if not self.trained(r):
            return False
        if self.committed(r) is not None:
            return True
        tasks = self.spec.eval_tasks
        return tasks is None or eval_done(self.run_dir(r), tasks, self.spec.eval_limit,
                                          self.spec.eval_loss)

    def has_checkpoint(self, r: RunSpec) -> bool:
        from remoe.rundir.loading import latest_checkpoint

        return latest_checkpoint(self.run_dir(r) / "checkpoints") is not None

    def has_weights(self, r: RunSpec) -> bool:
        """Whether ``r``'s run directory here holds a model (``final/`` or a checkpoint) that a
        run with ``init_from_run`` can start from (a committed copy has none)."""
        return (self.run_dir(r) / "final" / "config.json").is_file() or self.has_checkpoint(r)

    def match_flops(self, r: RunSpec) -> float | None:
        """The summed training FLOPs of the runs ``r`` matches (None: not all finished)."""
        if not r.match_of:
            return None
        by = self.spec.by_name()
        total = 0.0
        for name in r.match_of:
            s = self.summary(by[name])
            if not (s and s.get("flops")):
                return None
            total += float(s["flops"])
        return total

    def full_config(self, r: RunSpec) -> dict[str, Any]:
        return apply_stop(r, self.runs_dir, self.threads, self.match_flops(r))

    def check_existing(self, selected: list[RunSpec]) -> None:
        """A run directory made with another config than the spec's now: stop before anything
        starts (a summary or checkpoint of another experiment must not count or be resumed)."""
        bad = []
        for r in selected:
            if not run_has(self.source_dir(r), "config.yaml"):
                continue
            if r.match_of and self.match_flops(r) is None:
                continue  # its stop point is not known yet: checked once it is
            if not (self.summary(r) or self.has_checkpoint(r)):
                continue  # nothing to keep: it restarts from scratch
            have = Run(self.source_dir(r)).config
            want = same_experiment(self.full_config(r))
            diff = config_diff(same_experiment(have), want) if have else ["config.yaml unreadable"]
            if diff:
                bad.append(f"{r.name} ({'; '.join(diff[:3])})")
        if bad:
            where = f"{self.runs_dir}" + (f" (or their committed copies under "
                                          f"{self.spec.results_dir / 'runs'})"
                                          if self.spec.results_dir else "")
            raise ConfigError(f"--out={str(self.out)!r}: run(s) made with another config: "
                              f"{', '.join(bad)}; delete their directories under "
                              f"{where} or choose another --out")

    # -- reuse of identical runs from other studies ------------------------------------------
    def finished_elsewhere(self) -> list[tuple[Path, dict[str, Any]]]:
        return finished_runs(self.reuse, exclude=self.runs_dir)

    # -- selection ----------------------------------------------------------------------------
    def selected(self) -> list[RunSpec]:
        """The runs to consider, dependencies first; ``only`` plus what it depends on."""
        ordered = self.spec.ordered()
        if self.only is None:
            return ordered
        by = self.spec.by_name()
        want = set(self.only)
        stack = list(want)
        while stack:
            r = by[stack.pop()]
            for dep in r.deps:
                if dep not in want:
                    want.add(dep)
                    stack.append(dep)
        return [r for r in ordered if r.name in want]

    # -- state file -----------------------------------------------------------------------------
    def write_state(self, status: str) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        doc = {"spec": str(self.spec.path), "study": self.spec.name, "budget": self.spec.budget,
               "status": status, "updated": time.time(), "jobs": self.jobs,
               "threads_per_job": self.threads, "cores": cores(),
               "runs": {r.name: {"group": r.group, "label": r.label, "seed": r.seed,
                                 **self.states[r.name].to_dict()} for r in self.spec.runs}}
        atomic_write_text(self.out / STATE_FILE, json.dumps(doc, indent=2))

    def refresh_done(self) -> None:
        """Runs finished on disk are done, whatever an earlier (killed) study wrote."""
        for r in self.spec.runs:
            st = self.states[r.name]
            if st.state == "running":
                self._count_lost_attempt(r, st)
            if self.done(r):
                st.state = "done"
            elif st.state in ("running", "done"):
                st.state = "interrupted"  # a killed study or a deleted summary

    # -- the loop -------------------------------------------------------------------------------
    def run(self, poll_s: float = 0.5) -> int:
        """Run every selected run not yet done; 0 if all of them are done in the end."""
        self.out.mkdir(parents=True, exist_ok=True)
        lock = open(self.out / "study.lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConfigError(f"--out={str(self.out)!r} is in use by another remoe study "
                              "(study.lock is held)") from None
        try:
            return self._run(poll_s)
        finally:
            lock.close()

    def _run(self, poll_s: float) -> int:
        selected = self.selected()
        self.check_existing(selected)
        self.refresh_done()
        if self.reuse:
            adopt_identical(self, selected)
        todo = [r for r in selected if self.states[r.name].state != "done"]
        done = len(selected) - len(todo)
        self.log(f"study {self.spec.name}: {len(selected)} runs ({done} done, {len(todo)} to run), "
                 f"{self.jobs} at a time x {self.threads} thread(s) -> {self.out}")
        self._prepare_data(todo)
        for r in todo:
            self.states[r.name].state = "pending"
            self.states[r.name].message = None
        self.write_state("running")
        running: dict[str, tuple[subprocess.Popen, RunSpec, float, Any]] = {}
        by = self.spec.by_name()
        try:
            while todo or running:
                for name, (proc, r, t0, fh) in list(running.items()):
                    if proc.poll() is not None:
                        fh.close()
                        del running[name]
                        self._finished(r, proc.returncode, t0)
                        if self.states[name].state == "pending":  # trained, to evaluate
                            todo.insert(0, r)
                for r in list(todo):
                    dep = next((by[d] for d in r.deps
                                if self.states[d].state in ("failed", "skipped")), None)
                    why = "did not finish"
                    if dep is None and r.init_of and self.trained(by[r.init_of]) \
                            and not self.has_weights(by[r.init_of]):
                        dep, why = by[r.init_of], ("is only a committed copy here (no weights): "
                                                   "delete that copy to train it again")
                    if dep is not None:
                        todo.remove(r)
                        st = self.states[r.name]
                        st.state, st.message = "skipped", f"{dep.name} {why}"
                        how = ("starts from the weights of" if dep.name == r.init_of
                               else "matches the FLOPs of")
                        self.log(f"  skipped {r.name}: it {how} {dep.name}, which {why}")
                        self.write_state("running")
                while todo and len(running) < self.jobs:
                    ready = next((r for r in todo
                                  if all(self.trained(by[d]) for d in r.deps)), None)
                    if ready is None:
                        break
                    todo.remove(ready)
                    running[ready.name] = self._launch(ready)
                if todo and not running:  # cannot happen with a checked order; be safe
                    raise RuntimeError("study: runs wait for runs that will not finish: "
                                       + ", ".join(r.name for r in todo))
                time.sleep(poll_s)
        except KeyboardInterrupt:
            self._interrupt(running)
            self.write_state("interrupted")
            raise
        failed = [n for n in (r.name for r in selected) if self.states[n].state in
                  ("failed", "skipped")]
        self.write_state("failed" if failed else "done")
        if failed:
            self.log(f"study {self.spec.name}: {len(failed)} run(s) did not finish: "
                     + ", ".join(failed))
            return 1
        self.log(f"study {self.spec.name}: all {len(selected)} runs done")
        return 0

    def _prepare_data(self, todo: list[RunSpec]) -> None:
        """Build each data cache once, here, so that parallel children never race to build it."""
        if self.command is not default_command:
            return
        seen = set()
        for r in todo:
            exp = load_config(self.full_config(r))
            key = json.dumps(exp.to_dict()["data"], sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            from remoe.data import prepare_data

            prepare_data(exp.data, progress=False)

    def _launch(self, r: RunSpec):
        if self.trained(r):
            return self._launch_eval(r)
        cfg = self.full_config(r)
        if r.match_of:  # its stop point is known now: the same check as at start
            self.check_existing([r])
        path = self.config_path(r)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, yaml.safe_dump(cfg, sort_keys=False))
        resume = self.summary(r) is None and self.has_checkpoint(r)
        # no checkpoint yet but leftovers of a killed attempt: remoe train archives them
        # (to runs/<name>.old-<time>) and starts over
        from remoe.rundir import contents

        overwrite = not resume and bool(contents(self.run_dir(r)))
        flags = ["--resume"] if resume else (["--overwrite"] if overwrite else [])
        proc, fh = self._spawn(r, self.command(path.resolve(), flags),
                               "resume" if resume else "start")
        st = self.states[r.name]
        st.state, st.attempts, st.started, st.resumed = "running", st.attempts + 1, time.time(), resume
        st.exit_status, st.phase = None, "train"
        self.log(f"  {'resume' if resume else 'start '} {r.name}  [{r.describe_overrides()}] "
                 f"stop: {r.describe_stop()}  (pid {proc.pid}, log {self.log_path(r)})")
        self.write_state("running")
        return proc, r, time.time(), fh

    def _launch_eval(self, r: RunSpec):
        """The zero-shot tasks of the spec on a trained run (``remoe eval``), in its log."""
        tasks, limit = self.spec.eval_tasks, self.spec.eval_limit
        proc, fh = self._spawn(r, self.evaluate(self.run_dir(r), tasks, limit, self.spec.eval_loss),
                               "evaluate")
        st = self.states[r.name]
        st.state, st.started, st.exit_status, st.phase = "running", time.time(), None, "eval"
        self.log(f"  eval  {r.name}  [--tasks {tasks}{f' --limit {limit}' if limit else ''}] "
                 f"(pid {proc.pid}, log {self.log_path(r)})")
        self.write_state("running")
        return proc, r, time.time(), fh

    def _spawn(self, r: RunSpec, argv: list[str], what: str):
        log = self.log_path(r)
        log.parent.mkdir(parents=True, exist_ok=True)
        fh = open(log, "a")
        fh.write(f"\n==== remoe study: {what} {r.name} {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n")
        fh.flush()
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, preexec_fn=die_with_parent)
        return proc, fh

    def _finished(self, r: RunSpec, code: int, t0: float) -> None:
        st = self.states[r.name]
        st.exit_status, st.finished = code, time.time()
        add_wall(st, st.finished - t0)
        if code == 0 and self.done(r):
            st.state, st.message = "done", None
            self.log(f"  done  {r.name}  ({st.wall_s:.0f} s)")
        elif code == 0 and self.trained(r):  # trained; its zero-shot evaluation comes next
            st.state, st.message = "pending", None
            self.log(f"  trained {r.name}  ({st.wall_s:.0f} s); zero-shot evaluation to run")
        else:
            st.state = "failed"
            lines = tail(self.log_path(r))
            st.message = lines[-1] if lines else None
            self.log(f"  FAILED {r.name}: exit status {code} (log {self.log_path(r)}); last lines:\n"
                     + "\n".join("    | " + ln for ln in lines))
        self.write_state("running")
        if st.state == "done":
            # copied the moment it is done, so a study cut off later still has it to commit; a
            # failed copy must not stop the trainings still running (the end of the study and
            # --results-only copy it again)
            try:
                self.copy_to_results(r)
            except OSError as e:
                self.log(f"  warning: could not copy {r.name} to {self.spec.results_dir} ({e}); "
                         "the end of the study and --results-only try again")

    def copy_to_results(self, r: RunSpec) -> bool:
        """Copy the finished (and evaluated) run ``r``'s small outputs to the spec's
        ``results:`` directory (:func:`remoe.lab.study.archive.export_run`) unless the copy there is
        up to date; True if it copied."""
        results, d = self.spec.results_dir, self.run_dir(r)
        if results is None or not (d / "summary.json").is_file() or not self.done(r):
            return False
        dest = results / "runs" / r.name
        if up_to_date(d, dest):
            return False
        export_run(d, dest, self.states[r.name].to_dict())
        return True

    def _count_lost_attempt(self, r: RunSpec, st: RunState) -> None:
        """An earlier study process died (kill -9, machine stopped) while this child ran, so
        its attempt never reported: count it until the child's last write (its log, metrics,
        evaluations or checkpoint pointer), as it died with its parent."""
        d = self.run_dir(r)
        last = last_write([self.log_path(r), d / "metrics.jsonl", d / "eval.jsonl",
                           d / "checkpoints" / "LATEST", d / "eval_results.json"])
        if st.started and last is not None and last > float(st.started):
            add_wall(st, last - float(st.started))
        st.state = "interrupted"

    def _interrupt(self, running: dict) -> None:
        """Ctrl-C: ask every child to stop (SIGINT), wait, then SIGKILL the stragglers."""
        if not running:
            return
        self.log(f"interrupted: stopping {len(running)} run(s) (their last checkpoints stay; "
                 "run the same command again to continue)")
        for proc, _, _, _ in running.values():
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGINT)
                except ProcessLookupError:
                    pass
        deadline = time.time() + GRACE_S
        for name, (proc, r, t0, fh) in running.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            fh.close()
            st = self.states[name]
            st.exit_status, st.finished = proc.returncode, time.time()
            add_wall(st, st.finished - t0)
            st.state = "done" if self.done(r) else "interrupted"

