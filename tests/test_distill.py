"""Knowledge transfer (gemjax.distill, gemjax.models.student): the KD loss and the
representation loss against numpy, the Student Adapter's window (no future labels),
NaN inputs, the students' FLOP count against the dot products of their jaxpr, and a
teacher -> student run through the student Trainer's own train_step (frozen shared
tables bit-identical, the step's loss equal to the KD formula on its logits)."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.config import get_config
from gemjax.data.feeding import Feeder
from gemjax.data.source import make_source
from gemjax.distill import losses
from gemjax.distill.adapter import StudentAdapter, fit_platt
from gemjax.distill.batch import with_teacher
from gemjax.distill.transfer import (DistillConfig, Distiller, ReprCache, Teacher,
                                     refresh_student, student_config)
from gemjax.models import student as student_lib
from gemjax.train.step import Trainer
from tests.distill_teacher import CHEAP


def _np_bce(p, q):
    return -(p * np.log(q) + (1 - p) * np.log(1 - q))


def _sig(x):
    return 1 / (1 + np.exp(-x))


@pytest.mark.parametrize("alpha,temperature", [(0.0, 1.0), (0.5, 1.0), (0.7, 3.0), (1.0, 0.5)])
def test_kd_sums_match_numpy(alpha, temperature):
    rng = np.random.default_rng(0)
    b, k = 64, 3
    s, t = rng.normal(0, 2, (b, k)), rng.normal(0, 2, (b, k))
    y = (rng.random((b, k)) < 0.3).astype(np.float64)
    mask = (rng.random((b, k)) < 0.8).astype(np.float64)
    wts = rng.random(b)
    batch = types.SimpleNamespace(labels=jnp.float32(y), label_mask=jnp.float32(mask),
                                  weights=jnp.float32(wts), teacher_logits=jnp.float32(t))
    loss_sum, w_sum, pos_sum = losses.kd_objective(alpha, temperature).task_loss(jnp.float32(s), batch)
    w = mask * wts[:, None]
    T = temperature
    ref = ((1 - alpha) * _np_bce(y, _sig(s)) + alpha * T * T * _np_bce(_sig(t / T), _sig(s / T)))
    np.testing.assert_allclose(loss_sum, (ref * w).sum(0), rtol=2e-5)
    np.testing.assert_allclose(w_sum, w.sum(0), rtol=1e-6)
    np.testing.assert_allclose(pos_sum, (y * w).sum(0), rtol=1e-6)


def test_kd_soft_gradient_scale_and_bad_args():
    # the T^2 convention: d soft / d s -> (s - t) / 4 for large T
    s, t = jnp.float32([[0.3]]), jnp.float32([[-0.5]])
    g = jax.grad(lambda x: jnp.sum(losses.kd_loss(x, jnp.zeros((1, 1)), t, alpha=1.0,
                                                  temperature=100.0)))(s)
    np.testing.assert_allclose(g, (0.3 + 0.5) / 4, rtol=1e-3)
    with pytest.raises(ValueError, match="alpha"):
        losses.kd_objective(1.5, 1.0)
    with pytest.raises(ValueError, match="temperature"):
        losses.kd_objective(0.5, 0.0)


def test_feature_mse_matches_numpy():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(5, 7)), rng.normal(size=(5, 7))
    np.testing.assert_allclose(losses.feature_mse(jnp.float32(a), jnp.float32(b)),
                               ((a - b) ** 2).mean(-1), rtol=1e-5)
    g = jax.grad(lambda t: jnp.sum(losses.feature_mse(jnp.float32(a), t)))(jnp.float32(b))
    assert not np.any(np.asarray(g))          # no gradient into the teacher side


def _stream(seed, n_batches, b=64, flip_from=None):
    """Batches of (teacher logits [b, 2], labels, mask, weights): labels follow
    sigmoid(2 z - 1) (a miscalibrated teacher); from batch flip_from on, 1 - that."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_batches):
        z = rng.normal(0, 1.5, (b, 2))
        u = rng.random((b, 2))
        y = (u < _sig(2 * z - 1)).astype(np.float64)
        if flip_from is not None and i >= flip_from:
            y = 1 - y
        mask = np.ones((b, 2))
        mask[: b // 4, 1] = 0            # task 1 partly unlabeled
        out.append((z, y, mask, np.ones(b)))
    return out


def _soft_labels(stream, adapter):
    """The Distiller's order: correct a batch, then observe its labels."""
    soft = []
    for z, y, m, w in stream:
        soft.append(adapter.correct(z))
        adapter.observe(z, y, m, w)
    return soft


def test_adapter_sees_no_future_labels():
    t = 5
    same, flipped = _stream(0, 9), _stream(0, 9, flip_from=t)
    a = _soft_labels(same, StudentAdapter(2, window=200, refresh_every=1))
    b = _soft_labels(flipped, StudentAdapter(2, window=200, refresh_every=1))
    for i in range(t + 1):     # batch t is corrected before its (flipped) labels arrive
        np.testing.assert_array_equal(a[i], b[i])
    assert not np.allclose(a[t + 1], b[t + 1])   # the flipped labels do move the fit afterwards


def test_adapter_fits_the_newest_window_only():
    window = 150
    base = _stream(2, 6)
    other_past = _stream(3, 2) + base[2:]          # different labels before the window
    a, b = StudentAdapter(2, window=window), StudentAdapter(2, window=window)
    for z, y, m, w in base:
        a.observe(z, y, m, w)
    for z, y, m, w in other_past:
        b.observe(z, y, m, w)
    np.testing.assert_array_equal(a.coef, b.coef)
    # the coefficients are the penalised logistic fit on exactly the newest `window` rows
    for k in range(2):
        rows = [(z[:, k][m[:, k] > 0], y[:, k][m[:, k] > 0]) for z, y, m, _ in base]
        zz = np.concatenate([r[0] for r in rows])[-window:]
        yy = np.concatenate([r[1] for r in rows])[-window:]
        c = a.coef[k]
        p = _sig(c[0] * zz + c[1])
        grad = np.array([np.sum((p - yy) * zz), np.sum(p - yy)]) / len(zz) + 2e-3 * (c - [1, 0])
        np.testing.assert_allclose(grad, 0, atol=1e-8)
    # the miscalibrated teacher (labels ~ sigmoid(2 z - 1)) is corrected towards (2, -1)
    assert abs(a.coef[0, 0] - 2) < 0.6 and abs(a.coef[0, 1] + 1) < 0.6


def test_feature_adapter_matches_a_scipy_fit():
    """The features adapter's coefficients are the minimiser of the weighted, L2-penalised
    log loss (found here by scipy's BFGS), and `correct` is a z + b + w . f with them."""
    from scipy.optimize import minimize
    rng = np.random.default_rng(4)
    n, nf, l2 = 240, 3, 0.02
    z, f = rng.normal(0, 1.5, (n, 1)), rng.normal(0, 1, (n, nf))
    y = (rng.random(n) < _sig(0.7 * z[:, 0] + 0.3 + f @ [1.0, -0.5, 0.0])).astype(float)
    w = rng.uniform(0.5, 2.0, n)
    ad = StudentAdapter(1, window=n, num_features=nf, l2=l2)
    ad.observe(z[:120], y[:120, None], np.ones((120, 1)), w[:120], f[:120])
    ad.observe(z[120:], y[120:, None], np.ones((120, 1)), w[120:], f[120:])
    x = np.column_stack([z[:, 0], np.ones(n), f])
    prior = np.array([1.0, 0, 0, 0, 0])

    def loss(c):
        p = _sig(x @ c)
        return np.sum(w * -(y * np.log(p) + (1 - y) * np.log(1 - p))) / w.sum() + \
            l2 * np.sum((c - prior) ** 2)
    ref = minimize(loss, prior, method="BFGS", options={"gtol": 1e-10}).x
    np.testing.assert_allclose(ad.coef[0], ref, atol=1e-5)
    assert ad.coef[0, 2] > 0.3 and ad.coef[0, 3] < -0.1     # the planted feature weights' signs
    zt, ft = rng.normal(size=(5, 1)), rng.normal(size=(5, nf))
    np.testing.assert_allclose(ad.correct(zt, ft)[:, 0], np.column_stack([zt, np.ones(5), ft]) @ ref,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"features must be \[5, 3\]"):
        ad.correct(zt, ft[:, :2])


def test_feature_adapter_sees_no_future_labels():
    t, rng = 5, np.random.default_rng(5)
    feats = [rng.normal(size=(64, 2)) for _ in range(9)]

    def soft(stream):
        ad, out = StudentAdapter(2, window=200, refresh_every=1, num_features=2, l2=0.01), []
        for (z, y, m, w), f in zip(stream, feats):
            out.append(ad.correct(z, f))
            ad.observe(z, y, m, w, f)
        return out
    a, b = soft(_stream(0, 9)), soft(_stream(0, 9, flip_from=t))
    for i in range(t + 1):
        np.testing.assert_array_equal(a[i], b[i])
    assert not np.allclose(a[t + 1], b[t + 1])


def test_nan_inputs_are_named():
    ad = StudentAdapter(2, window=10)
    z = np.zeros((4, 2))
    z[1, 1] = np.nan
    with pytest.raises(ValueError, match="teacher_logits.*non-finite"):
        ad.correct(z)
    with pytest.raises(ValueError, match="labels.*non-finite"):
        ad.observe(np.zeros((4, 2)), np.full((4, 2), np.nan), np.ones((4, 2)), np.ones(4))
    batch = types.SimpleNamespace(labels=np.zeros((4, 2)))
    rep = np.zeros((4, 3))
    rep[2, 0] = np.inf
    with pytest.raises(ValueError, match="teacher_repr.*non-finite"):
        with_teacher(batch, np.zeros((4, 2)), rep)
    with pytest.raises(ValueError, match="teacher_logits: shape"):
        with_teacher(batch, np.zeros((3, 2)), np.zeros((4, 3)))
    with pytest.raises(ValueError, match="needs kd"):
        DistillConfig(methods="adapter").validate()
    with pytest.raises(ValueError, match="unknown"):
        DistillConfig(methods="kd,magic").validate()
    with pytest.raises(ValueError, match="adapter_kind"):
        DistillConfig(methods="kd,adapter", adapter_kind="mlp").validate()
    with pytest.raises(ValueError, match="adapter_features"):
        DistillConfig(methods="kd,adapter", adapter_kind="features",
                      adapter_features="dense,age").validate()


def test_repr_cache_serves_within_its_window():
    c = ReprCache(window=3)
    f0 = np.arange(6.0).reshape(3, 2)
    out0 = c.serve(np.array([7, 8, 7]), f0, step=0)
    np.testing.assert_array_equal(out0, [f0[0], f0[1], f0[0]])       # user 7 cached at its first row
    out1 = c.serve(np.array([7, 9]), f0[:2] + 100, step=2)
    np.testing.assert_array_equal(out1, [f0[0], f0[1] + 100])         # 7 still fresh enough
    out2 = c.serve(np.array([7]), f0[:1] + 200, step=3)
    np.testing.assert_array_equal(out2, f0[:1] + 200)                 # 3 steps old: refreshed


def _dot_flops(fn, *args) -> int:
    """2 * (product of the output dims) * (contracted size) summed over the dot_generals
    of fn's jaxpr (recursing into sub-jaxprs)."""
    total = 0

    def walk(jaxpr):
        nonlocal total
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (lc, _), _ = eqn.params["dimension_numbers"]
                lhs = eqn.invars[0].aval.shape
                total += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(
                    np.prod([lhs[d] for d in lc]))
            for v in eqn.params.values():
                for sub in (v if isinstance(v, (list, tuple)) else [v]):
                    if hasattr(sub, "jaxpr"):
                        walk(getattr(sub.jaxpr, "jaxpr", sub.jaxpr))
                    elif hasattr(sub, "eqns"):
                        walk(sub)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return total


@pytest.mark.parametrize("over", [
    "model.student_arch=dlrm",
    "model.student_arch=dlrm,model.student_width=4,model.teacher_repr_dim=12",
    "model.student_arch=wukong,model.wukong_layers=2,model.teacher_repr_dim=5"])
def test_student_flops_match_its_jaxpr(over):
    cfg = get_config("tiny", "model.kind=student," + over)
    # the model's parameters as shapes only: the jaxpr is all the count reads
    graphdef, params = nnx.split(nnx.eval_shape(lambda: student_lib.Student(cfg, rngs=nnx.Rngs(0))))
    stream = make_source(cfg, "train")
    batch, _ = stream.shard_batch(0, 0, 1)
    b = batch.labels.shape[0]
    rep = np.ones((b, cfg.model.student.teacher_repr_dim), np.float32)
    batch = with_teacher(batch, np.zeros(batch.labels.shape, np.float32), rep)
    from gemjax.data.batch import id_features
    acts = {n: jax.ShapeDtypeStruct(np.shape(ids) + (cfg.model.dim,), jnp.float32)
            for n, ids in id_features(batch, student_lib.schema_of(cfg).id_fields).items()}
    got = _dot_flops(lambda p, a, bt: nnx.merge(graphdef, p)(a, bt), params, acts, batch)
    assert got == b * student_lib.forward_flops(cfg)


# The students of the Distiller tests share their train-step programs: the adapter, the repr
# cache and normaliser, the shared tables' start (share_accum, share_dense) and
# share_freeze_steps are host-side, so a program depends on the student's config, the KD
# objective and the teacher inputs (FROZEN: kd,adapter,repr,share frozen, alpha 0.6, T 2;
# TUNED: kd with or without the adapter or tuned shared tables, alpha 0.5, T 1).
FROZEN = "model.kind=student,model.student_width=4,train.steps=4"
TUNED = "model.kind=student,train.warmup_steps=1"


@pytest.fixture(scope="module")
def teacher_and_feed():
    tcfg = get_config("tiny", f"train.steps=4,{CHEAP}")    # tests/distill_teacher.py
    tt = Trainer.create(tcfg)
    teacher = Teacher(tt, tt.init_state(0))
    stream = make_source(tcfg, "train")
    feeder = Feeder(stream.shard_batch, tt.mesh, check_ids=tt.coll.check_ids,
                    id_fields=tt.id_fields, prefetch=0)
    batches = [b for _, b, _, _ in feeder.batches(0, 3)]
    for b in batches[:2]:
        teacher.train(b)            # a teacher that is not its initial state
    return tcfg, teacher, batches


def _sigmoid_np(x):
    return 1 / (1 + np.exp(-np.asarray(x, np.float64)))


def test_distill_step_frozen_share_and_kd_loss(teacher_and_feed):
    tcfg, teacher, batches = teacher_and_feed
    before = jax.device_get(teacher.state)
    dcfg = DistillConfig(methods="kd,adapter,repr,share", alpha=0.6, temperature=2.0,
                         adapter_refresh=1, repr_window=2)
    scfg = student_config(get_config("tiny", FROZEN), tcfg, dcfg)
    assert scfg.optim.sparse.lr == 0.0 and scfg.model.dim == tcfg.model.dim
    d = Distiller(Trainer.create(scfg, teacher.trainer.mesh), teacher, dcfg)
    state = d.init_state(1)
    # the train step's loss is the KD formula on the student's logits (same train_step)
    sbatch, raw = d.prepare(batches[0], 0)
    probs = np.asarray(d._eval(state, sbatch), np.float64)
    s = np.log(probs) - np.log1p(-probs)
    t = np.asarray(sbatch.teacher_logits, np.float64)
    y = np.asarray(sbatch.labels, np.float64)
    w = np.asarray(sbatch.label_mask) * np.asarray(sbatch.weights)[:, None]
    ref = (0.4 * _np_bce(y, _sig(s)) + 0.6 * 4 * _np_bce(_sig(t / 2), _sig(s / 2)))
    _, m = d._step(jax.tree.map(jnp.copy, state), sbatch)
    np.testing.assert_allclose(float(m["loss"]), (ref * w).sum() / w.sum(), rtol=1e-4)
    for i, b in enumerate(batches):
        state, m = d.step(state, b, i)
        assert np.isfinite(float(m["loss"]))
    assert d.adapter.fits == len(batches) and d.cache.hits > 0
    after = jax.device_get(teacher.state)
    for n in state["tables"]:     # frozen: the shared teacher rows bit-identical after training
        np.testing.assert_array_equal(np.asarray(state["tables"][n]["weights"]),
                                      after["tables"][n]["weights"])
    jax.tree.map(np.testing.assert_array_equal, before, after)   # offline teacher untouched
    # refresh_student (for the online trainer) runs the same steps from a given teacher state
    state2, ms = refresh_student(d, state, teacher.state, batches[:1], start_step=10)
    assert len(ms) == 1 and int(state2["step"]) == len(batches) + 1


def test_feature_adapter_in_the_distiller(teacher_and_feed):
    """adapter_kind=features: the adapter fits on [teacher logit, 1, dense inputs, teacher
    repr, the student's logits before its step] of the observed batches, and the soft
    labels are that fit's prediction."""
    tcfg, teacher, batches = teacher_and_feed
    dcfg = DistillConfig(methods="kd,adapter", adapter_refresh=1, adapter_kind="features",
                         adapter_features="dense,repr,student", adapter_l2=0.05)
    scfg = student_config(get_config("tiny", TUNED), tcfg, dcfg)
    d = Distiller(Trainer.create(scfg, teacher.trainer.mesh), teacher, dcfg)
    state = d.init_state(1)

    def features(b, state):
        raw, rep = teacher.outputs(b)
        p = np.asarray(d._eval(state, with_teacher(b, raw, np.zeros((len(raw), 0), np.float32),
                                                   d.mesh)), np.float64)
        return raw, np.column_stack([np.asarray(b.dense), rep, np.log(p) - np.log1p(-p)])
    feats = []
    for i, b in enumerate(batches[:2]):
        feats.append(features(b, state)[1])
        state, _ = d.step(state, b, i)
    nd, k = np.shape(batches[0].dense)[1], np.shape(batches[0].labels)[1]
    assert d.adapter.num_features == feats[0].shape[1] and nd > 0 and feats[0].shape[1] > nd + k
    m = [np.asarray(b.label_mask)[:, 0] * np.asarray(b.weights) > 0 for b in batches[:2]]
    _, _, _, f = d.adapter.window_rows(0)
    np.testing.assert_allclose(f, np.concatenate([x[j] for x, j in zip(feats, m)]),
                               rtol=1e-4, atol=1e-4)
    assert np.any(d.adapter.coef[:, 2:] != 0)
    raw, x = features(batches[2], state)
    want = raw * d.adapter.coef[:, 0] + d.adapter.coef[:, 1] + x @ d.adapter.coef[:, 2:].T
    sbatch, _ = d.prepare(batches[2], 2, state=state)
    np.testing.assert_allclose(np.asarray(sbatch.teacher_logits), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(d.corrected_teacher(batches[2], state), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="student's state"):
        d.prepare(batches[2], 2)


def test_distill_tuned_share_updates_tables(teacher_and_feed):
    tcfg, teacher, batches = teacher_and_feed
    dcfg = DistillConfig(methods="kd,share", share="tuned")
    scfg = student_config(get_config("tiny", TUNED), tcfg, dcfg)
    d = Distiller(Trainer.create(scfg, teacher.trainer.mesh), teacher, dcfg)
    state = d.init_state(1)
    state, _ = d.step(state, batches[0], 0)
    assert not np.array_equal(np.asarray(state["tables"]["item"]["weights"]),
                              np.asarray(teacher.state["tables"]["item"]["weights"]))


def test_cotrain_trains_the_teacher_and_frozen_share_follows_it(teacher_and_feed):
    tcfg, teacher, batches = teacher_and_feed
    tt = teacher.trainer
    live = Teacher(tt, jax.tree.map(jnp.copy, teacher.state))
    dcfg = DistillConfig(methods="kd,adapter,repr,share", alpha=0.6, temperature=2.0,
                         adapter_refresh=1, repr_window=2, teacher_mode="cotrain")
    scfg = student_config(get_config("tiny", FROZEN), tcfg, dcfg)
    d = Distiller(Trainer.create(scfg, tt.mesh), live, dcfg)
    state = d.init_state(1)
    t0 = int(live.state["step"])
    state, _ = d.step(state, batches[0], 0)
    seen = jax.device_get(live.state["tables"])        # what the second step copies
    state, _ = d.step(state, batches[1], 1)
    assert int(live.state["step"]) == t0 + 2            # the teacher trained on both batches
    for n in state["tables"]:   # frozen: the student holds the teacher's rows of its step
        np.testing.assert_array_equal(np.asarray(state["tables"][n]["weights"]),
                                      seen[n]["weights"])
    assert not np.array_equal(seen["item"]["weights"],
                              np.asarray(live.state["tables"]["item"]["weights"]))


def test_student_trains_and_checkpoints_with_the_train_loop(tmp_path):
    from gemjax.serve.restore import restore
    from gemjax.train.loop import train
    cfg = get_config("tiny", "model.kind=student,model.student_arch=wukong,train.steps=2,"
                             "train.checkpoint_every=2,train.eval_every=2,train.log_every=2,"
                             "train.tensorboard=false")
    summary = train(cfg, str(tmp_path), log=lambda *_: None)
    assert np.isfinite(summary["eval_ne"])
    run = restore(str(tmp_path))
    assert run.step == 2 and run.cfg.model.kind == "student"


def test_repr_normalizer_matches_numpy():
    """Standardised teacher features: (x - mean) / sqrt(var + eps) with the statistics of
    every training row seen so far; before any row, x unchanged."""
    from gemjax.distill.transfer import ReprNormalizer
    rng = np.random.default_rng(0)
    xs = [rng.normal(3.0, 2.0, (n, 5)) * np.arange(1, 6) for n in (7, 4, 9)]
    norm = ReprNormalizer(eps=1e-6)
    np.testing.assert_array_equal(norm.apply(xs[0]), xs[0].astype(np.float32))
    for i, x in enumerate(xs):
        norm.update(x)
        seen = np.concatenate(xs[:i + 1])
        want = (xs[0] - seen.mean(0)) / np.sqrt(seen.var(0) + 1e-6)
        np.testing.assert_allclose(norm.apply(xs[0]), want, rtol=1e-5, atol=1e-5)


def test_repr_norm_and_dropout_in_the_distiller(teacher_and_feed):
    """repr_norm=standardize, repr_dropout=p: a training batch's teacher features are the
    fresh ones standardised by the training rows so far (this batch included), each
    row zeroed when the seeded draw says so; eval reads the final statistics, updates
    none of them and drops nothing."""
    tcfg, teacher, batches = teacher_and_feed
    p = 0.5
    dcfg = DistillConfig(methods="kd,repr", repr_window=0, repr_norm="standardize",
                         repr_dropout=p)
    scfg = student_config(get_config("tiny", FROZEN), tcfg, dcfg)
    d = Distiller(Trainer.create(scfg, teacher.trainer.mesh), teacher, dcfg)
    state = d.init_state(3)
    draws = np.random.default_rng(3)
    seen, dropped = [], 0
    for i, b in enumerate(batches[:2]):
        rep = np.asarray(teacher.outputs(b)[1], np.float64)
        seen.append(rep)
        rows = np.concatenate(seen)
        want = (rep - rows.mean(0)) / np.sqrt(rows.var(0) + 1e-6)
        keep = draws.random(len(rep)) >= p
        want[~keep] = 0.0
        dropped += int(np.sum(~keep))
        sbatch, _ = d.prepare(b, i, state=state)
        np.testing.assert_allclose(np.asarray(sbatch.teacher_repr), want, rtol=1e-4, atol=1e-4)
    assert 0 < dropped < 2 * len(rep)
    n = d.norm.n
    rep = np.asarray(teacher.outputs(batches[2])[1], np.float64)
    rows = np.concatenate(seen)
    sbatch, _ = d.prepare(batches[2], 2, training=False)
    np.testing.assert_allclose(np.asarray(sbatch.teacher_repr),
                               (rep - rows.mean(0)) / np.sqrt(rows.var(0) + 1e-6),
                               rtol=1e-4, atol=1e-4)
    d.predict(state, batches[2])
    assert d.norm.n == n == len(rows)          # eval batches never reach the statistics


def test_share_fresh_accumulators_freeze_then_tune_and_dense_groups(teacher_and_feed):
    """Tuned share with share_accum=fresh starts from the teacher's rows with the
    student's own (zero) Adagrad accumulators; share_freeze_steps=2 keeps them the
    teacher's rows through two steps (the rest of the student trains), the third
    tunes them; share_dense
    copies the teacher's dense_proj; the teacher's state never changes."""
    tcfg, teacher, batches = teacher_and_feed
    before = jax.device_get(teacher.state)
    dcfg = DistillConfig(methods="kd,share", share="tuned", share_accum="fresh",
                         share_freeze_steps=2, share_dense="dense_proj")
    scfg = student_config(get_config("tiny", TUNED), tcfg, dcfg)
    d = Distiller(Trainer.create(scfg, teacher.trainer.mesh), teacher, dcfg)
    state = d.init_state(1)
    assert any(np.any(before["tables"][n]["accum"] > 0) for n in state["tables"])
    for n in state["tables"]:
        np.testing.assert_array_equal(np.asarray(state["tables"][n]["weights"]),
                                      before["tables"][n]["weights"])
        np.testing.assert_array_equal(np.asarray(state["tables"][n]["accum"]), 0.0)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state["params"]["dense_proj"]),
                 before["params"]["dense_proj"])
    for i in range(2):                 # frozen for the first two steps (the sparse lr has no warm-up)
        state, _ = d.step(state, batches[i], i)
        for n in state["tables"]:
            np.testing.assert_array_equal(np.asarray(state["tables"][n]["weights"]),
                                          before["tables"][n]["weights"])
    assert not np.array_equal(np.asarray(state["params"]["dense_proj"]["kernel"]),
                              before["params"]["dense_proj"]["kernel"])
    state, _ = d.step(state, batches[2], 2)
    assert not np.array_equal(np.asarray(state["tables"]["item"]["weights"]),
                              before["tables"]["item"]["weights"])
    jax.tree.map(np.testing.assert_array_equal, before, jax.device_get(teacher.state))
    bad = dataclasses.replace(dcfg, share_dense="head")
    d2 = Distiller(Trainer.create(scfg, teacher.trainer.mesh), teacher, bad)
    with pytest.raises(ValueError, match="share_dense: 'head'"):
        d2.init_state(1)


def test_sequence_less_gem_teacher_repr_is_its_user_row():
    """A gem teacher without sequences serves its looked-up row of the sample's user
    feature (E = dim), read here from the table in logical row order (the teacher:
    tests/distill_teacher.py's, one Wukong layer)."""
    from gemjax.distill.represent import repr_dim
    tcfg = get_config("tiny", f"model.use_sequences=false,{CHEAP}")
    tt = Trainer.create(tcfg)
    teacher = Teacher(tt, tt.init_state(0))
    assert repr_dim(tcfg) == tcfg.model.dim
    feeder = Feeder(make_source(tcfg, "train").shard_batch, tt.mesh, prefetch=0)
    host, _, _ = feeder.host_batch(0)
    _, rep = teacher.outputs(feeder.to_device(host))
    from gemjax.config import schema_of
    table = next(f.table for f in schema_of(tcfg).sparse if f.name == "user")
    rows = tt.coll.to_logical(jax.device_get(teacher.state["tables"]))[table]["weights"]
    np.testing.assert_allclose(rep, np.asarray(rows, np.float32)[np.asarray(host.sparse["user"])],
                               rtol=1e-6)
