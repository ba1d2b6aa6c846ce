"""Validation sweep: search --override fields, pick on validation, read test once.

    python -m experiments.sweep --config=tiny --workdir=runs/sweep --trials=20 --seeds=0,1 \
        --space='train.dense_lr=loguniform(1e-4,3e-2);model.dim=choice(8,16,32);model.wukong_layers=int(1,3)' \
        --override=train.steps=200,data.valid_path=synthetic

Each trial is one point of --space, trained once per --seeds entry, every run its
own process (`python -m experiments.train`, so GPU or CPU as the trainer finds it)
in WORKDIR/trials/NNNN/seed_S (output in WORKDIR/trials/NNNN/seed_S.log) with
train.select_metric=--metric, data.eval_path empty (the test rows are not read
while searching) and train.seed=S. A trial's objective is the mean over its seeds
of summary.json["selection"]["best_value"] (the best validation eval of the run);
--metric ne / loss / log_loss are minimised, the rest maximised.

Search space (--space): ';'-separated `field=kind(args)` entries, field any
`section.field` of --override:

    loguniform(lo, hi)     float, log scale      uniform(lo, hi)      float
    int(lo, hi[, step])    integer in [lo, hi]   logint(lo, hi)       integer, log scale
    choice(a, b, ...)      one of the values, as --override text (tuples as 64:64)

The sampler is Optuna's (--sampler: tpe, its Tree-structured Parzen Estimator, or
random), seeded by --seed; --sampler=grid queues every combination of the choice /
int entries once, in order, as Optuna trials.

After the budget the chosen setting (best mean validation) is evaluated on the test
rows once: `experiments.train --mode=eval` of each of its seed runs (their best
checkpoints) with data.eval_path set to the config's. The table (top trials by
validation, the chosen setting's test mean ± std over seeds) is printed last and
written to WORKDIR/table.md; WORKDIR/sweep.json holds every trial and the test read.

Resume: the study lives in WORKDIR/study.journal (Optuna's JournalStorage, an
append-only JSON-lines file, fsynced per write), the sweep's settings in
WORKDIR/spec.json. Rerunning the same command continues: finished trials stay, an
interrupted trial reruns its unfinished seeds (each resumes from its checkpoints),
and a rerun with another --space, --config, --override, --seeds, --metric,
--sampler or --seed is refused; --trials may grow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import json
import math
import os
import re
import shlex
import statistics
import sys
import time
from typing import Callable, Sequence

from absl import app, flags

# STOP_CODES: the exit codes a stopped trial ends with (named here for the sweep's readers)
from experiments.child import STOP_CODES, Stopped, check_stopped, run_process  # noqa: F401
from experiments.seeds import parse_seeds
from gemjax.config import PRESETS, Config, apply_overrides, get_config, parse_overrides


def define_flags() -> None:
    """The command line's flags (defined when run as a program, so that importing this
    module beside another experiments program defines no flag twice)."""
    flags.DEFINE_string("config", "small", f"preset: one of {sorted(PRESETS)}")
    flags.DEFINE_string("workdir", "runs/sweep", "the sweep's directory (a rerun continues the sweep in it)")
    flags.DEFINE_string("override", "", "comma-separated section.field=value of every trial (e.g. "
                        "train.steps=500,data.valid_path=synthetic); the trial's own values go on top")
    flags.DEFINE_string("features", "", "JSON feature schema of data.source=parquet files (passed to the trials)")
    flags.DEFINE_string("space", "", "';'-separated field=kind(args): loguniform(lo,hi), uniform(lo,hi), "
                        "int(lo,hi[,step]), logint(lo,hi), choice(a,b,...)")
    flags.DEFINE_integer("trials", 20, "budget: trials run to completion (a rerun with more extends the sweep)")
    flags.DEFINE_list("seeds", ["0"], "train.seed of each run of a trial (the objective is their mean)")
    flags.DEFINE_string("metric", "", "validation metric to select on (train.select_metric; default: the "
                        "config's train.select_metric, else hr@10 for model.kind=retrieval, else ne)")
    flags.DEFINE_enum("sampler", "tpe", ["tpe", "random", "grid"], "Optuna sampler")
    flags.DEFINE_integer("seed", 0, "seed of the sampler")
    flags.DEFINE_integer("top", 10, "trials in the table")
    flags.DEFINE_string("train_flags", "", "extra flags of every experiments.train call (shell words), "
                        "e.g. '--cpu_devices=2 --compile_cache='")
    flags.DEFINE_string("python", sys.executable, "interpreter of the trial processes")


MINIMIZE = ("ne", "loss", "log_loss")
# fields the sweep sets itself in every run
RESERVED = ("train.seed", "train.select_metric", "data.eval_path")
KINDS = {"loguniform": 2, "uniform": 2, "int": (2, 3), "logint": 2, "choice": None}
SPEC_FILE, JOURNAL, RESULT = "spec.json", "study.journal", "result.json"


class SweepError(ValueError):
    """A sweep that cannot run as asked (the message names the flag or file)."""


# --------------------------------------------------------------------------- search space

@dataclasses.dataclass(frozen=True)
class Param:
    """One --space entry: `name` (section.field), `kind`, numeric `args` or `choices`
    (override text)."""

    name: str
    kind: str
    args: tuple = ()
    choices: tuple[str, ...] = ()

    def distribution(self):
        """The Optuna distribution of this entry."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
        if self.kind == "choice":
            return CategoricalDistribution(self.choices)
        if self.kind in ("uniform", "loguniform"):
            return FloatDistribution(self.args[0], self.args[1], log=self.kind == "loguniform")
        step = self.args[2] if len(self.args) == 3 else 1
        return IntDistribution(self.args[0], self.args[1], step=step, log=self.kind == "logint")

    def grid(self) -> list:
        """Every value of a choice / int entry (SweepError for a continuous one)."""
        if self.kind == "choice":
            return list(self.choices)
        if self.kind == "int":
            step = self.args[2] if len(self.args) == 3 else 1
            return list(range(self.args[0], self.args[1] + 1, step))
        raise SweepError(f"--space entry {self.name}: --sampler=grid takes choice() and int() "
                         f"entries only, got {self.kind}()")

    def text(self) -> str:
        inner = self.choices if self.kind == "choice" else self.args
        return f"{self.name}={self.kind}({','.join(str(a) for a in inner)})"


ENTRY = re.compile(r"^\s*([A-Za-z_][\w]*\.[A-Za-z_]\w*)\s*=\s*([a-z]+)\s*\((.*)\)\s*$", re.S)


def parse_space(text: str, base: Config | None = None) -> list[Param]:
    """--space text -> Params, in order. SweepError naming the bad entry: syntax, an
    unknown kind, wrong argument count or types, lo >= hi, log bounds <= 0, a repeated
    or reserved field; with `base`, every bound and choice is applied to it as an
    override, so an unknown field or a value the config rejects fails here."""
    entries = [e for e in text.split(";") if e.strip()]
    if not entries:
        raise SweepError("--space is empty: give ';'-separated entries like "
                         "'train.dense_lr=loguniform(1e-4,1e-2);model.dim=choice(16,32)'")
    out: list[Param] = []
    for entry in entries:
        where = f"--space entry {entry.strip()!r}"
        m = ENTRY.match(entry)
        if not m:
            raise SweepError(f"{where}: expected section.field=kind(args), e.g. model.dim=choice(16,32)")
        name, kind, inner = m.groups()
        if kind not in KINDS:
            raise SweepError(f"{where}: unknown kind {kind!r}; choose one of {sorted(KINDS)}")
        if name in RESERVED:
            raise SweepError(f"{where}: {name} is set by the sweep itself ({', '.join(RESERVED)})")
        if any(p.name == name for p in out):
            raise SweepError(f"{where}: {name} appears twice")
        raw = [a.strip() for a in inner.split(",")]
        if any(not a for a in raw):
            raise SweepError(f"{where}: empty argument")
        if kind == "choice":
            if len(set(raw)) != len(raw):
                raise SweepError(f"{where}: repeated choice")
            p = Param(name, kind, choices=tuple(raw))
        else:
            want = KINDS[kind] if isinstance(KINDS[kind], tuple) else (KINDS[kind],)
            if len(raw) not in want:
                raise SweepError(f"{where}: {kind}() takes {' or '.join(map(str, want))} arguments, "
                                 f"got {len(raw)}")
            num = float if kind in ("uniform", "loguniform") else int
            try:
                args = tuple(num(a) for a in raw)
            except ValueError:
                raise SweepError(f"{where}: {kind}() takes {num.__name__} arguments, got {raw}") from None
            if not all(math.isfinite(a) for a in args) or not args[0] < args[1]:
                raise SweepError(f"{where}: needs finite lo < hi, got lo={raw[0]} hi={raw[1]}")
            if kind.startswith("log") and args[0] <= 0:
                raise SweepError(f"{where}: a log scale needs lo > 0, got {raw[0]}")
            if len(args) == 3 and (args[2] < 1 or (args[1] - args[0]) % args[2]):
                raise SweepError(f"{where}: step must be >= 1 and divide hi - lo")
            p = Param(name, kind, args=args)
        if base is not None:
            for value in (p.choices or p.args[:2]):
                try:
                    apply_overrides(base, {name: str(value)})
                except ValueError as e:
                    raise SweepError(f"{where}: {e}") from None
        out.append(p)
    return out


def param_overrides(params: dict) -> dict[str, str]:
    """Trial params -> override values (floats in repr: exact when parsed back)."""
    return {k: repr(v) if isinstance(v, float) else str(v) for k, v in params.items()}


def direction(metric: str) -> str:
    """'minimize' for ne / loss / log_loss (any task/surface prefix), else 'maximize'."""
    return "minimize" if metric.rsplit("/", 1)[-1] in MINIMIZE else "maximize"


# --------------------------------------------------------------------------- runs

Runner = Callable[[Sequence[str], str, str], int]
# (argv, run workdir, log path) -> exit code; tests replace it
RUNNER: Runner = run_process


@dataclasses.dataclass
class Sweep:
    """What every run of the sweep shares: `base` the config after --override, the
    argv pieces of experiments.train, the metric and the seeds."""

    workdir: str
    config: str
    base_override: dict[str, str]
    base: Config
    metric: str
    seeds: list[int]
    features: str = ""
    train_flags: tuple[str, ...] = ()
    python: str = sys.executable

    def seed_dir(self, number: int, seed: int) -> str:
        return os.path.join(self.trial_dir(number), f"seed_{seed}")

    def trial_dir(self, number: int) -> str:
        return os.path.join(self.workdir, "trials", f"{number:04d}")

    def train_argv(self, number: int, seed: int, params: dict) -> list[str]:
        """experiments.train of one seed of trial `number`: the test rows unread."""
        over = {"train.baselines": "false", **self.base_override, **self.valid_default(),
                **param_overrides(params),
                "train.select_metric": self.metric, "train.seed": str(seed), "data.eval_path": ""}
        return [self.python, "-m", "experiments.train", f"--config={self.config}",
                f"--workdir={self.seed_dir(number, seed)}",
                f"--override={','.join(f'{k}={v}' for k, v in over.items())}",
                *([f"--features={self.features}"] if self.features else []), *self.train_flags]

    def valid_default(self) -> dict[str, str]:
        """data.valid_path=synthetic for the synthetic source when none is given."""
        if not getattr(self.base.data, "valid_path", "") and self.base.data.source == "synthetic":
            return {"data.valid_path": "synthetic"}
        return {}

    def eval_argv(self, number: int, seed: int) -> list[str]:
        """experiments.train --mode=eval of one seed run on the config's test rows."""
        return [self.python, "-m", "experiments.train", "--mode=eval",
                f"--workdir={self.seed_dir(number, seed)}",
                f"--override=data.eval_path={self.base.data.eval_path}", *self.train_flags]


def read_json(path: str) -> dict | None:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError):
        return None


def write_json(path: str, obj) -> None:
    """Atomic: a reader sees the old file or the whole new one."""
    with open(path + ".tmp", "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)


def selection_value(sweep: Sweep, run_dir: str) -> float | None:
    """summary.json["selection"]["best_value"] of a finished run (None: not finished)."""
    summary = read_json(os.path.join(run_dir, "summary.json"))
    sel = (summary or {}).get("selection")
    if not sel or sel.get("best_value") is None:
        return None
    if sel.get("metric", sweep.metric) != sweep.metric:
        raise SweepError(f"{run_dir}/summary.json selected on {sel['metric']!r}, the sweep on "
                         f"{sweep.metric!r}")
    return float(sel["best_value"])


def run_trial(sweep: Sweep, number: int, params: dict, runner: Runner) -> dict:
    """Train every seed of trial `number` (seeds with a finished summary.json are
    kept) and write its result.json: {"params", "values" (per seed), "mean", "std",
    "wall_s"} or {"params", "error"}. Stopped when a run stops on a signal."""
    os.makedirs(sweep.trial_dir(number), exist_ok=True)
    values, t0, error = [], time.monotonic(), None
    for seed in sweep.seeds:
        run_dir = sweep.seed_dir(number, seed)
        value = selection_value(sweep, run_dir)
        if value is None:
            log = os.path.join(sweep.trial_dir(number), f"seed_{seed}.log")
            code = runner(sweep.train_argv(number, seed, params), run_dir, log)
            check_stopped(code, f"trial {number} seed {seed}")
            value = selection_value(sweep, run_dir)
            if code != 0 or value is None:
                error = (f"seed {seed}: exit {code}" + ("" if code else ", no selection in summary.json")
                         + f" (see {log})")
                break
        if not math.isfinite(value):
            error = f"seed {seed}: validation {sweep.metric} is {value}"
            break
        values.append(value)
    result = {"number": number, "params": params, "wall_s": round(time.monotonic() - t0, 2)}
    if error:
        result["error"] = error
    else:
        result.update(values=values, mean=statistics.fmean(values),
                      std=statistics.stdev(values) if len(values) > 1 else 0.0)
    write_json(os.path.join(sweep.trial_dir(number), RESULT), result)
    return result


def read_test(sweep: Sweep, number: int, runner: Runner) -> dict:
    """The test eval of every seed run of trial `number` (its best checkpoint), cached in
    WORKDIR/test.json; {"trial", "values", "mean", "std", "rows" (per seed)}."""
    path = os.path.join(sweep.workdir, "test.json")
    reads = read_json(path) or {}
    done = reads.get(str(number), {}).get("rows", {})
    for seed in sweep.seeds:
        if str(seed) in done:
            continue
        run_dir = sweep.seed_dir(number, seed)
        best_step = ((read_json(os.path.join(run_dir, "summary.json")) or {})
                     .get("selection", {}).get("best_step"))
        log = os.path.join(sweep.trial_dir(number), f"seed_{seed}.test.log")
        code = runner(sweep.eval_argv(number, seed), run_dir, log)
        check_stopped(code, f"test read of trial {number} seed {seed}")
        row = read_json(os.path.join(run_dir, "eval", f"step_{best_step}.json"))
        if code != 0 or row is None or sweep.metric not in row:
            raise SweepError(f"test read of trial {number} seed {seed}: exit {code}, no "
                             f"{sweep.metric!r} in {run_dir}/eval/step_{best_step}.json (see {log})")
        done[str(seed)] = {k: v for k, v in row.items() if isinstance(v, (int, float))}
        reads[str(number)] = {"rows": done}
        write_json(path, reads)
    values = [done[str(s)][sweep.metric] for s in sweep.seeds]
    return {"trial": number, "metric": sweep.metric, "values": values,
            "mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "rows": done}


# --------------------------------------------------------------------------- study

@contextlib.contextmanager
def sweep_lock(workdir: str):
    """One sweep process per directory (flock: the kernel drops it on any exit)."""
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "sweep.lock"), "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SweepError(f"--workdir={workdir}: another sweep is running in it") from None
        yield


def check_spec(workdir: str, spec: dict) -> None:
    """Write WORKDIR/spec.json, or refuse a rerun whose settings differ from it."""
    path = os.path.join(workdir, SPEC_FILE)
    old = read_json(path)
    if old is None:
        if os.path.exists(os.path.join(workdir, JOURNAL)):
            raise SweepError(f"{path} is missing or unreadable beside {JOURNAL}: refusing to guess "
                             f"the sweep's settings; use a new --workdir")
        write_json(path, spec)
        return
    changed = [k for k in sorted(set(old) | set(spec)) if old.get(k) != spec.get(k)]
    if changed:
        lines = "; ".join(f"{k}: was {old.get(k)!r}, now {spec.get(k)!r}" for k in changed)
        raise SweepError(f"--workdir={workdir} holds a sweep with other settings ({lines}); rerun with "
                         f"the same flags to continue it (only --trials may change), or use a new --workdir")


def repair_journal(path: str) -> None:
    """Cut a partial last line (a write cut short by a crash), which Optuna would
    otherwise glue to the next record."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as fh:
        data = fh.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            print(f"[sweep] {path}: dropping a partial last record ({len(data) - keep} bytes)", flush=True)
            fh.truncate(keep)


def open_study(workdir: str, params: list[Param], sampler: str, seed: int, direction_: str):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = os.path.join(workdir, JOURNAL)
    repair_journal(path)
    with contextlib.suppress(FileNotFoundError):   # a lock left by a killed sweep (we hold sweep.lock)
        os.remove(path + ".lock")
    storage = JournalStorage(JournalFileBackend(path, lock_obj=JournalFileOpenLock(path)))
    study = optuna.create_study(study_name="sweep", storage=storage, direction=direction_,
                                sampler=optuna.samplers.RandomSampler(seed=seed), load_if_exists=True)
    # A sampler's random stream restarts with the process: a resumed sweep seeds it with
    # seed + trials so far, so it draws no repeat of the points the first process drew.
    seed += len(study.get_trials(deepcopy=False))
    if sampler == "grid":   # every combination queued once (Optuna's GridSampler stops only optimize())
        for point in itertools.product(*(p.grid() for p in params)):
            study.enqueue_trial(dict(zip((p.name for p in params), point)), skip_if_exists=True)
        study.sampler = optuna.samplers.RandomSampler(seed=seed)
    elif sampler == "random":
        study.sampler = optuna.samplers.RandomSampler(seed=seed)
    else:
        study.sampler = optuna.samplers.TPESampler(seed=seed)
    return study


def progress(sweep: Sweep, result: dict, done: int, budget: int) -> None:
    params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in result["params"].items())
    if "error" in result:
        tail = f"FAILED {result['error']}"
    else:
        per = " ".join(f"{v:.5f}" for v in result["values"])
        tail = f"valid {sweep.metric} {per} mean {result['mean']:.5f}"
    print(f"[sweep] trial {result['number']} ({done}/{budget}) {params}: {tail} "
          f"{result['wall_s']:.1f} s", flush=True)


def finish(study, number: int, result: dict) -> None:
    from optuna.trial import TrialState
    if "error" in result:
        study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
    else:
        study.tell(number, result["mean"], skip_if_finished=True)


def search(sweep: Sweep, params: list[Param], budget: int, sampler: str, seed: int,
           runner: Runner | None = None, log: Callable[[str], None] = print):
    """Run trials until `budget` have finished (complete or failed); resumes the study
    in sweep.workdir. Returns the study."""
    from optuna.trial import TrialState
    runner = runner or RUNNER
    study = open_study(sweep.workdir, params, sampler, seed, direction(sweep.metric))
    if sampler == "grid":
        size = math.prod(len(p.grid()) for p in params)
        if budget > size:
            log(f"[sweep] --sampler=grid: {size} combinations, so {size} trials, not {budget}")
            budget = size
    dists = {p.name: p.distribution() for p in params}

    def counted():
        return [t for t in study.get_trials(deepcopy=False)
                if t.state in (TrialState.COMPLETE, TrialState.FAIL)
                and os.path.exists(os.path.join(sweep.trial_dir(t.number), RESULT))]

    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):   # a stopped sweep's
        result = read_json(os.path.join(sweep.trial_dir(t.number), RESULT))
        if result is not None:            # finished, not yet told
            finish(study, t.number, result)
        elif set(t.params) != set(dists):  # stopped inside ask(): nothing ran
            study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        elif len(counted()) < budget:
            log(f"[sweep] resuming trial {t.number}")
            result = run_trial(sweep, t.number, dict(t.params), runner)
            finish(study, t.number, result)
            progress(sweep, result, len(counted()), budget)
    fails = 0
    while len(counted()) < budget:
        if sampler == "grid" and not study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            break                        # every queued combination ran
        trial = study.ask(dists)
        result = run_trial(sweep, trial.number, dict(trial.params), runner)
        finish(study, trial.number, result)
        progress(sweep, result, len(counted()), budget)
        fails = fails + 1 if "error" in result else 0
        if fails >= 3:
            raise SweepError(f"3 trials in a row failed; the last: {result['error']}")
    return study


# --------------------------------------------------------------------------- report

def trial_rows(sweep: Sweep, study) -> list[dict]:
    """result.json of every finished trial, best validation first, failed last."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        r = read_json(os.path.join(sweep.trial_dir(t.number), RESULT))
        if r is not None:
            rows.append({**r, "state": t.state.name})
    sign = 1 if direction(sweep.metric) == "minimize" else -1
    return sorted(rows, key=lambda r: (("error" in r), sign * r.get("mean", 0.0), r["number"]))


def fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def table(sweep: Sweep, params: list[Param], rows: list[dict], test: dict | None, top: int) -> str:
    """Markdown: the top trials by validation, then the chosen setting's test figures."""
    names = [p.name for p in params]
    head = ["trial", *names, f"valid {sweep.metric} per seed", "mean ± std", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows[:top]:
        if "error" in r:
            vals, mean = "failed", r["error"]
        else:
            vals = " ".join(f"{v:.5f}" for v in r["values"])
            mean = f"{r['mean']:.5f} ± {r['std']:.5f}"
        lines.append("| " + " | ".join([str(r["number"]), *(fmt(r["params"].get(n)) for n in names),
                                        vals, mean, f"{r['wall_s']:.1f}"]) + " |")
    ok = [r for r in rows if "error" not in r]
    lines.append("")
    if not ok:
        lines.append("no trial finished: nothing chosen, no test read")
    lines.append(f"{len(ok)} trials finished, {len(rows) - len(ok)} failed; seeds {sweep.seeds}; "
                 f"validation {sweep.metric} ({direction(sweep.metric)}d)")
    if test is not None:
        best = next(r for r in ok if r["number"] == test["trial"])
        setting = ", ".join(f"{k}={fmt(v)}" for k, v in best["params"].items())
        per = " ".join(f"{v:.5f}" for v in test["values"])
        lines.append(f"chosen: trial {test['trial']} ({setting}): valid {sweep.metric} "
                     f"{best['mean']:.5f} ± {best['std']:.5f}, test {sweep.metric} "
                     f"{test['mean']:.5f} ± {test['std']:.5f} over {len(test['values'])} seeds ({per})")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main

def default_metric(cfg: Config) -> str:
    return getattr(cfg.train, "select_metric", "") or ("hr@10" if cfg.model.kind == "retrieval" else "ne")


def _seeds(seeds: Sequence[str]) -> list[int]:
    try:
        return parse_seeds(seeds)
    except ValueError as e:
        raise SweepError(str(e)) from None


def build(f) -> tuple[Sweep, list[Param], dict]:
    """The Sweep, its Params and its spec (what a rerun must match) from the flags."""
    if f.trials < 1:
        raise SweepError(f"--trials must be >= 1, got {f.trials}")
    try:
        cfg = get_config(f.config)
        if f.features:
            from gemjax.features import FeatureSchema
            with open(f.features) as fh:
                cfg = dataclasses.replace(cfg, features=FeatureSchema.from_dict(json.load(fh)))
        base_override = parse_overrides(f.override)
        cfg = apply_overrides(cfg, base_override)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SweepError(f"--config={f.config} --override / --features: {e}") from None
    reserved = sorted(set(base_override) & {"train.seed", "train.select_metric"})
    if reserved:
        raise SweepError(f"--override: {reserved} are set by the sweep itself (--seeds, --metric)")
    metric = f.metric or default_metric(cfg)
    sweep = Sweep(workdir=f.workdir, config=f.config, base_override=base_override, base=cfg,
                  metric=metric, seeds=_seeds(f.seeds), features=f.features,
                  train_flags=tuple(shlex.split(f.train_flags)), python=f.python)
    if cfg.data.source != "synthetic" and not getattr(cfg.data, "valid_path", ""):
        raise SweepError("--override: give data.valid_path (the validation rows the trials select on)")
    params = parse_space(f.space, cfg)
    spec = {"config": f.config, "override": base_override, "features": f.features,
            "space": [p.text() for p in params], "seeds": sweep.seeds, "metric": metric,
            "sampler": f.sampler, "seed": f.seed, "train_flags": list(sweep.train_flags)}
    return sweep, params, spec


def run_sweep(sweep: Sweep, params: list[Param], spec: dict, budget: int, top: int = 10,
              runner: Runner | None = None) -> dict:
    """Search, read test once for the chosen trial, write sweep.json and table.md;
    returns sweep.json's dict."""
    try:
        import optuna
    except ImportError:
        raise SweepError("the sweep needs Optuna: pip install -c constraints.txt -e '.[sweep]' "
                         "(at run time optuna, colorlog, tqdm, PyYAML, packaging, numpy)") from None
    runner = runner or RUNNER
    with sweep_lock(sweep.workdir):
        check_spec(sweep.workdir, spec)
        study = search(sweep, params, budget, spec["sampler"], spec["seed"], runner)
        rows = trial_rows(sweep, study)
        ok = [r for r in rows if "error" not in r]
        test = read_test(sweep, ok[0]["number"], runner) if ok else None
        text = table(sweep, params, rows, test, top)
        out = {"spec": spec, "metric": sweep.metric, "direction": direction(sweep.metric),
               "trials": rows, "chosen": ok[0] if ok else None, "test": test,
               "optuna": optuna.__version__}
        write_json(os.path.join(sweep.workdir, "sweep.json"), out)
        with open(os.path.join(sweep.workdir, "table.md.tmp"), "w") as fh:
            fh.write(text)
        os.replace(os.path.join(sweep.workdir, "table.md.tmp"), os.path.join(sweep.workdir, "table.md"))
    print(text, end="", flush=True)
    return out


def trainer_selects() -> bool:
    """Whether experiments.train selects on validation (TrainConfig.select_metric)."""
    from gemjax.config import TrainConfig
    return "select_metric" in {fd.name for fd in dataclasses.fields(TrainConfig)}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not trainer_selects():
        sys.exit("[sweep] this gemjax's TrainConfig has no select_metric: its trainer cannot select "
                 "on validation, so a sweep has nothing to pick on")
    try:
        sweep, params, spec = build(flags.FLAGS)
    except SweepError as e:
        raise app.UsageError(str(e))
    try:
        run_sweep(sweep, params, spec, flags.FLAGS.trials, flags.FLAGS.top)
    except Stopped as e:
        print(f"[sweep] {e}; rerun the same command to continue", flush=True)
        sys.exit(130)
    except (SweepError, RuntimeError) as e:
        sys.exit(f"[sweep] {e}")
    except KeyboardInterrupt:
        print("[sweep] interrupted; rerun the same command to continue", flush=True)
        sys.exit(130)


if __name__ == "__main__":
    define_flags()
    app.run(main)
