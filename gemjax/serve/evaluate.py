"""Eval-only: a run's checkpoint through the training's Evaluator (train.py --mode=eval).

    row = evaluate_checkpoint(workdir, step=None, mesh=None)

Restores the checkpoint (default: the best one, WORKDIR/best, when the run selected
one, else the newest; or `step`: "best", "newest", a step number) onto `mesh`, runs
`gemjax.train.loop.Evaluator` (the eval stream and eval step of training) and
writes the row to WORKDIR/eval/step_<N>.json, N the checkpoint step (a rerun
replaces it). The row holds the keys of the training's eval rows in
metrics.jsonl ("ne", "auc", "calibration", "log_loss", per task and per
surface/task, "bayes_ne", "loss") with kind "eval_only", plus the mesh and
device count it ran on. On the training's mesh (the same shard count) the
figures equal the training's eval row of that step exactly; on another device
count the eval stream is cut into that many shards (other samples of the same
stream distribution).

It writes its own file rather than a metrics.jsonl row: metrics.jsonl belongs
to the training run (a resume rewrites it up to the restored step, a running
training appends to it), and an eval-only run may happen beside a training run.
"""

from __future__ import annotations

import json
import os
from typing import Callable

from gemjax.serve.restore import restore

KIND = "eval_only"


def eval_path(workdir: str, step: int) -> str:
    return os.path.join(workdir, "eval", f"step_{step}.json")


def evaluate_checkpoint(workdir: str, step: int | str | None = None, mesh=None, *,
                        trainer_kw: dict | None = None, overrides: str | dict | None = None,
                        log: Callable[[str], None] = print, wrap: Callable | None = None) -> dict:
    """Eval metrics of checkpoint `step` (default: best, else newest) of the run in `workdir`.

    mesh / trainer_kw: where to restore and evaluate (Trainer.create); overrides:
    on top of the run's config.json (e.g. "data.eval_batches=64" for a longer eval).
    wrap: (RestoredRun) -> the trainer whose eval step runs (default run.trainer; a
    student reading its teacher's features: gemjax.distill.runs.evaluate_student);
    without it such a model is refused (inference.check_self_contained).
    Returns the row written to `eval_path(workdir, step)` (by process 0 only).
    """
    import jax

    from gemjax.serve.inference import check_self_contained
    from gemjax.train.loop import Evaluator
    from gemjax.train.metrics import flat
    from gemjax.train.retrieval import RetrievalEvaluator, is_retrieval

    run = restore(workdir, step, mesh, trainer_kw=trainer_kw, overrides=overrides)
    if wrap is None:
        check_self_contained(run.cfg, workdir)
    retrieval = is_retrieval(run.cfg)      # HR / NDCG rows instead of NE / AUC
    evaluator = (RetrievalEvaluator if retrieval else Evaluator)(
        run.trainer if wrap is None else wrap(run), run.cfg)
    res = evaluator(run.state)
    figures = res if retrieval else {"loss": res["log_loss"], **flat(res)}
    row = {"step": run.step, "kind": KIND, **figures,
           "bayes_ne": evaluator.bayes["ne"], "mesh": dict(run.trainer.mesh.shape),
           "devices": run.trainer.num_shards, "eval_batches": run.cfg.data.eval_batches}
    if jax.process_index() == 0:
        path = eval_path(workdir, run.step)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(row, f, indent=1)
        os.replace(path + ".tmp", path)
        which = os.path.basename(run.directory)     # best (the selection's) or checkpoints
        bayes = "" if evaluator.bayes["ne"] is None else f" (Bayes {evaluator.bayes['ne']:.6f})"
        if retrieval:
            log(f"{evaluator.line(run.step, res)} (checkpoint of {workdir}, {which}) -> {path}")
        else:
            log(f"[eval] checkpoint step {run.step} of {workdir} ({which}) on mesh {row['mesh']}: NE {res['ne']:.6f}"
                f"{bayes} AUC {res['auc']:.6f} calibration {res['calibration']:.4f} -> {path}")
    return row
