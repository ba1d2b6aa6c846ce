"""Knowledge transfer, one table: a teacher, students trained with each transfer
method, their eval NE over seeds.

    python -m experiments.distill --dataset=synthetic --seeds=0,1,2 --out=runs/distill

Per seed:
1. The teacher (`--teacher_override` on the dataset's base config; model.kind=gem by
   default) trains with gemjax.train.loop.train into OUT/<dataset>/teacher_sSEED (a
   finished one, with summary.json, is reused) and is read back from its checkpoint
   (`Teacher.from_workdir`: the offline teacher). --teacher_mode=cotrain trains a fresh
   teacher inside each student's run instead (the same batches, the teacher's outputs
   taken before it trains on them; the teacher's NE is that of the first row's
   teacher after --student_steps steps; no hierarchical row).
2. One student (model.kind=student, `--student_override`: by default a DLRM of the
   teacher's width 16, so shared tables need no projection) per row, trained
   --student_steps steps from the same init seed on the same stream with
   gemjax.distill.transfer.Distiller (the student Trainer's own train_step):
     none      the labels alone
     kd        standard KD (--alpha, --temperature)
     kd+adapter    KD on the Student Adapter's corrected teacher logits
     +repr     kd+adapter and the teacher's sequence embeddings as inputs (each sample's
               own by default; --repr_window=N serves a user's cached one up to N steps)
     +share    kd+adapter and the teacher's embedding tables (--share tuned by default,
               or frozen: then checked bit-identical after training)
     all       kd+adapter+repr+share
     hier      (--hierarchical) teacher -> domain model (a wider wukong student,
               kd+adapter) -> the student (kd+adapter)
3. Every model's NE on the dataset's eval stream (synthetic: data.eval_batches
   batches; Frappe: every row of test.parquet). gain = NE(none) - NE(row), per seed;
   the table shows mean ± std (population) over seeds and the ratio of the combined
   gain to the KD gain.
4. The students' budget: forward FLOPs per sample (gemjax.models.student.forward_flops,
   matmuls) and CPU latency of the forward at batch 512 (the eval step, one device,
   median of 10 calls after a warm-up).

--dataset=frappe reads the converted Frappe of --frappe_dir (experiments/frappe.py
converts it); when it is absent the run says so and exits 0. --data_overrides applies
to the dataset config of every model (e.g. the drift fields of data.*).
Writes OUT/<dataset>/results.json and OUT/<dataset>/table.md and prints the table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time

from absl import app, flags, logging

ROWS = {"none": "", "kd": "kd", "kd+adapter": "kd,adapter", "+repr": "kd,adapter,repr",
        "+share": "kd,adapter,share", "all": "kd,adapter,repr,share"}

# the synthetic teacher / student on the tiny preset's data (a few CPU minutes)
SYNTHETIC_DATA = ("data.batch_size=128,data.vocab_user=2000,data.vocab_item=400,data.seq_median=8,"
                  "data.seq_cap=32,data.recent=8,data.eval_batches=8")
TEACHER = ("model.kind=gem,model.dim=16,model.wukong_layers=2,model.fmb_tokens=4,"
           "model.lcb_tokens=4,model.fm_rank=4,model.wukong_mlp=32,model.head_mlp=32,"
           "train.dense_lr=4e-3,train.sparse_lr=0.2")
STUDENT = ("model.kind=student,model.student_arch=dlrm,model.dim=16,model.head_mlp=16,"
           "model.student_recent=8,train.dense_lr=4e-3,train.sparse_lr=0.2")
DOMAIN = "model.kind=student,model.student_arch=wukong,model.dim=16,model.head_mlp=32"


def define_flags():
    flags.DEFINE_enum("dataset", "synthetic", ["synthetic", "frappe"], "data of every model")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds (teacher and student init, stream)")
    flags.DEFINE_string("out", "runs/distill", "results.json, table.md and teacher runs")
    flags.DEFINE_integer("teacher_steps", 400, "teacher train steps")
    flags.DEFINE_integer("student_steps", 150, "student train steps")
    flags.DEFINE_string("data_overrides", "", "data.* overrides for every model")
    flags.DEFINE_string("teacher_override", TEACHER, "teacher config overrides")
    flags.DEFINE_string("student_override", STUDENT, "student config overrides")
    flags.DEFINE_list("rows", list(ROWS), f"rows of the table: {', '.join(ROWS)}")
    flags.DEFINE_bool("hierarchical", True, "add the teacher -> domain -> student row")
    flags.DEFINE_enum("teacher_mode", "offline", ["offline", "cotrain"], "teacher outputs from")
    flags.DEFINE_float("alpha", 0.5, "KD weight of the soft term")
    flags.DEFINE_float("temperature", 1.0, "KD temperature")
    flags.DEFINE_integer("adapter_window", 2048, "labeled rows per task the adapter fits on")
    flags.DEFINE_integer("adapter_refresh", 10, "steps between adapter refits")
    flags.DEFINE_integer("repr_window", 0,
                         "steps a cached user embedding is served (0: the sample's own)")
    flags.DEFINE_enum("share", "tuned", ["frozen", "tuned"], "shared teacher tables")
    flags.DEFINE_string("frappe_dir", "/tmp/gemjax-data/frappe", "converted Frappe")
    flags.DEFINE_integer("latency_batch", 512, "batch of the CPU latency figure (0: skip)")
    flags.DEFINE_string("compile_cache", os.path.join(tempfile.gettempdir(), "gemjax-jax-cache"),
                        "persistent jax compilation cache ('': none); seeds share programs")


def base_config(dataset: str, frappe_dir: str, data_overrides: str):
    """The dataset's config (its data section; model and train come from overrides)."""
    from gemjax.config import apply_overrides, get_config
    if dataset == "frappe":
        from gemjax.data.features import FeatureSchema
        with open(os.path.join(frappe_dir, "schema.json")) as f:
            schema = FeatureSchema.from_dict(json.load(f))
        cfg = dataclasses.replace(get_config("frappe"), features=schema)
        cfg = apply_overrides(cfg, f"data.train_path={frappe_dir}/train.parquet,"
                                   f"data.eval_path={frappe_dir}/test.parquet,"
                                   f"data.batch_size=512,train.warmup_steps=20")
    else:
        cfg = get_config("tiny", SYNTHETIC_DATA)
    cfg = apply_overrides(cfg, "train.tensorboard=false,train.baselines=false")
    return apply_overrides(cfg, data_overrides) if data_overrides else cfg


def model_config(base, override: str, steps: int, seed: int):
    from gemjax.config import apply_overrides
    every = max(steps, 1)
    return apply_overrides(base, f"{override},train.steps={steps},train.seed={seed},"
                                 f"train.warmup_steps={min(20, steps // 4)},train.log_every={every},"
                                 f"train.eval_every={every},train.checkpoint_every={every}")


def train_teacher(cfg, workdir: str):
    from gemjax.train.loop import train
    if not os.path.exists(os.path.join(workdir, "summary.json")):
        train(cfg, workdir, log=lambda *_: None)


def run_student(scfg, tcfg, teacher, methods: str, args, steps: int, mesh):
    """(eval metrics, Distiller, state) of one student trained with `methods`."""
    import numpy as np
    from gemjax.data.feeding import Feeder
    from gemjax.data.source import make_source
    from gemjax.distill.transfer import (DistillConfig, Distiller, Teacher, evaluate,
                                         student_config)
    from gemjax.train.step import Trainer
    dcfg = DistillConfig(methods=methods, temperature=args.temperature, alpha=args.alpha,
                         adapter_window=args.adapter_window, adapter_refresh=args.adapter_refresh,
                         repr_window=args.repr_window, share=args.share,
                         teacher_mode=args.teacher_mode)
    if args.teacher_mode == "cotrain":
        tt = Trainer.create(tcfg, mesh)
        teacher = Teacher(tt, tt.init_state(tcfg.train.seed))
    cfg = student_config(scfg, tcfg, dcfg)
    d = Distiller(Trainer.create(cfg, mesh), teacher, dcfg)
    state = d.init_state(cfg.train.seed)
    stream = make_source(cfg, "train")
    feeder = Feeder(stream.shard_batch, mesh, check_ids=d.trainer.coll.check_ids,
                    id_fields=d.trainer.id_fields)
    for step, batch, _, _ in feeder.batches(0, steps):
        state, _ = d.step(state, batch, step)
    res = evaluate(cfg, lambda b: d.predict(state, b), mesh)
    if "share" in methods and args.share == "frozen":
        same = all(np.array_equal(np.asarray(state["tables"][n]["weights"]),
                                  np.asarray(teacher.state["tables"][n]["weights"]))
                   for n in state["tables"])
        res["shared_tables_unchanged"] = bool(same) if args.teacher_mode == "offline" else None
    return res, d, state


def latency_ms(cfg, batch_size: int, mesh) -> float:
    """Median ms of the eval step (forward + lookup) on one batch of `batch_size`."""
    import jax
    import numpy as np
    from gemjax.config import apply_overrides
    from gemjax.data.feeding import Feeder
    from gemjax.data.source import make_source
    from gemjax.distill.batch import with_teacher
    from gemjax.train.step import Trainer
    cfg = apply_overrides(cfg, f"data.batch_size={batch_size}")
    tr = Trainer.create(cfg, mesh)
    state = tr.init_state(0)
    feeder = Feeder(make_source(cfg, "eval").shard_batch, mesh, prefetch=0)
    host, _, _ = feeder.host_batch(0)
    batch = feeder.to_device(host)
    if cfg.model.teacher_repr_dim:
        batch = with_teacher(batch, np.zeros(host.labels.shape, np.float32),
                             np.ones((batch_size, cfg.model.teacher_repr_dim), np.float32), mesh)
    step = tr.make_eval_step()
    jax.block_until_ready(step(state, batch))
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(step(state, batch))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def budget_rows(base, args, tcfg, mesh) -> list[dict]:
    """Per student variant: FLOPs per sample, parameters, table bytes, CPU latency."""
    from gemjax.distill.transfer import DistillConfig, student_config
    from gemjax.models import student as student_lib
    from gemjax.models.gem import table_specs
    out = []
    variants = {"student": "", "student+repr": "repr", "student+share": "share",
                "domain (wukong)": None}
    for name, methods in variants.items():
        if methods is None:
            cfg = model_config(base, DOMAIN, 1, 0)
        else:
            cfg = student_config(model_config(base, args.student_override, 1, 0), tcfg,
                                 DistillConfig(methods=methods, share=args.share))
        tables = sum(s.vocab * s.dim * 4 for s in table_specs(cfg))
        row = {"model": name, "arch": cfg.model.student_arch,
               "flops_per_sample": student_lib.forward_flops(cfg),
               "table_bytes": tables,
               "own_table_bytes": 0 if methods == "share" else tables,
               "latency_ms_b512": (round(latency_ms(cfg, args.latency_batch, mesh), 2)
                                   if args.latency_batch else None)}
        out.append(row)
    return out


def summarize(results: list[dict], rows: list[str], teacher_ne: list[float]) -> tuple[str, dict]:
    """Markdown table (NE and gain, mean ± std over seeds) and the figures behind it."""
    import numpy as np
    seeds = sorted({r["seed"] for r in results})
    ne = {row: np.array([next(r["ne"] for r in results if r["row"] == row and r["seed"] == s)
                         for s in seeds]) for row in rows}
    base = ne.get("none")
    lines = ["| model | NE (mean ± std) | gain vs none (mean ± std) |", "|---|---|---|",
             f"| teacher | {np.mean(teacher_ne):.4f} ± {np.std(teacher_ne):.4f} | |"]
    figures = {"teacher_ne": [float(x) for x in teacher_ne]}
    for row in rows:
        gain = base - ne[row] if base is not None else None
        g = "" if gain is None else f"{gain.mean():+.4f} ± {gain.std():.4f}"
        lines.append(f"| student {row} | {ne[row].mean():.4f} ± {ne[row].std():.4f} | {g} |")
        figures[row] = {"ne": ne[row].tolist(), "gain": None if gain is None else gain.tolist()}
    if base is not None and "kd" in ne and "all" in ne:
        kd_gain, all_gain = (base - ne["kd"]).mean(), (base - ne["all"]).mean()
        ratio = all_gain / kd_gain if kd_gain != 0 else float("nan")
        figures["combined_over_kd_gain"] = float(ratio)
        note = "" if kd_gain > 0 else " (the KD gain is not positive: no ratio to read)"
        lines.append(f"\ncombined gain / KD gain: {ratio:.2f} (seeds {seeds}){note}")
    return "\n".join(lines), figures


def main(argv):
    del argv
    args = flags.FLAGS
    logging.set_verbosity(logging.WARNING)      # orbax's per-checkpoint info lines
    import jax
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    from gemjax.distill.transfer import Teacher, evaluate
    from gemjax.train.step import default_mesh
    if args.dataset == "frappe" and not os.path.exists(os.path.join(args.frappe_dir, "schema.json")):
        print(f"[distill] --dataset=frappe: no converted Frappe in {args.frappe_dir} (run "
              f"python -m experiments.frappe, or experiments/convert_frappe.py, first); skipped")
        return
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        raise app.UsageError(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    out = os.path.join(args.out, args.dataset)
    os.makedirs(out, exist_ok=True)
    base = base_config(args.dataset, args.frappe_dir, args.data_overrides)
    mesh = default_mesh(jax.devices()[:1])
    hier = args.hierarchical and args.teacher_mode == "offline"
    if args.hierarchical and not hier:
        print("[distill] --teacher_mode=cotrain: no hierarchical row (its domain model is an "
              "offline teacher)")
    rows = list(args.rows) + (["hier"] if hier else [])
    results, teacher_ne = [], []
    t_start = time.time()
    for seed in [int(s) for s in args.seeds]:
        tcfg = model_config(base, args.teacher_override, args.teacher_steps, seed)
        scfg = model_config(base, args.student_override, args.student_steps, seed)
        teacher = None
        if args.teacher_mode == "offline":
            workdir = os.path.join(out, f"teacher_s{seed}")
            train_teacher(tcfg, workdir)
            teacher = Teacher.from_workdir(workdir, mesh=mesh)
            step = teacher.trainer.make_eval_step()
            teacher_ne.append(evaluate(tcfg, lambda b: step(teacher.state, b), mesh)["ne"])
        for row in rows:
            t0 = time.time()
            if row == "hier":
                dom_cfg = model_config(base, DOMAIN, args.teacher_steps // 2, seed)
                _, dd, dstate = run_student(dom_cfg, tcfg, teacher, "kd,adapter", args,
                                            args.teacher_steps // 2, mesh)
                domain = Teacher(dd.trainer, dstate)
                res, _, _ = run_student(scfg, dom_cfg, domain, "kd,adapter", args,
                                        args.student_steps, mesh)
            else:
                res, d, _ = run_student(scfg, tcfg, teacher, ROWS[row], args, args.student_steps,
                                        mesh)
                if args.teacher_mode == "cotrain" and row == rows[0]:
                    # the co-trained teacher of the first row, after its student_steps steps
                    step = d.teacher.trainer.make_eval_step()
                    teacher_ne.append(evaluate(tcfg, lambda b: step(d.teacher.state, b), mesh)["ne"])
            results.append({"seed": seed, "row": row, "ne": res["ne"], "auc": res["auc"],
                            "calibration": res["calibration"],
                            "shared_tables_unchanged": res.get("shared_tables_unchanged"),
                            "seconds": round(time.time() - t0, 1)})
            print(f"[distill] seed {seed} {row:10s} NE {res['ne']:.4f} AUC {res['auc']:.4f} "
                  f"({results[-1]['seconds']} s)", flush=True)
    table, figures = summarize(results, rows, teacher_ne or [float("nan")])
    tcfg = model_config(base, args.teacher_override, 1, 0)
    budget = budget_rows(base, args, tcfg, mesh)
    btable = ["| student | arch | FLOPs / sample | table bytes (own) | CPU ms, batch "
              f"{args.latency_batch} |", "|---|---|---|---|---|"]
    btable += [f"| {r['model']} | {r['arch']} | {r['flops_per_sample']:,} | "
               f"{r['table_bytes']:,} ({r['own_table_bytes']:,}) | {r['latency_ms_b512']} |"
               for r in budget]
    t_steps = (f"{args.teacher_steps} steps" if args.teacher_mode == "offline"
               else f"trained with each student, {args.student_steps} steps")
    text = (f"dataset {args.dataset}, teacher {args.teacher_mode} ({t_steps}), "
            f"students {args.student_steps} steps, seeds {args.seeds}\n\n{table}\n\n"
            + "\n".join(btable))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"flags": {k: getattr(args, k) for k in (
                       "dataset", "seeds", "teacher_steps", "student_steps", "data_overrides",
                       "teacher_override", "student_override", "teacher_mode", "alpha",
                       "temperature", "adapter_window", "adapter_refresh", "repr_window", "share")},
                   "runs": results, "summary": figures, "budget": budget,
                   "wall_s": round(time.time() - t_start, 1)}, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    define_flags()
    app.run(main)
