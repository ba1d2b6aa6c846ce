"""MovieLens-1M next-item prediction with the GEM sequence stack as the user tower.

    python -m experiments.movielens --out=runs/movielens/results.json           # today's model
    python -m experiments.movielens --positions=learned --l2norm --loss=sampled \\
        --block_dropout=0.2 --final_norm=false --heads=1 --select=fixed --epochs=100  # SASRec recipe
    python -m experiments.movielens --limit_users=64 --max_len=20 --epochs=2    # CPU smoke

Protocol (gemjax.data.movielens): leave-last-out, the --max_len (200) most recent
events, full ranking over the 3,706 items that occur. `test` excludes the items
of the history window from the ranking, as the published evaluation does
(generative-recommenders research/data/eval.py); `test_unmasked` keeps them.
Published (HSTU README): SASRec HR@10 0.2853 / NDCG@10 0.1603, HSTU 0.3097 / 0.1720.

Selection without looking at test (--select):
  valid  train on the train histories minus their last item, evaluate HR@10 on
         that held-out item every --eval_every epochs, stop after --patience
         evaluations without gain; then (--refit, default) retrain from scratch
         on the full train histories for the picked number of epochs and report
         test from the refit model (`test_early_stopped`: the picked model itself).
  fixed  train on the full train histories for --epochs and report test at the
         end (the practice of the generative-recommenders repository: 101 epochs,
         no validation split).

The recipe of generative-recommenders configs/ml-1m/sasrec-sampled-softmax-n128-final.gin
(with research/modeling/sequential/{sasrec,input_features_preprocessors,
output_postprocessors,autoregressive_losses}.py, losses/sampled_softmax.py,
trainer/train.py): item dim 50, 2 blocks, 1 head, FFN 50 relu, dropout 0.2 on
the input and inside the blocks (attention probabilities, FFN), learned absolute
positions added to sqrt(d)-scaled item embeddings, l2-normalised user and item
vectors, temperature 0.05, sampled softmax over 128 negatives drawn uniformly
per position (a negative equal to the target is masked), AdamW lr 1e-3,
betas (0.9, 0.98), no weight decay, batch 128, 101 epochs. Their block is
post-LN SASRec; ours stays the pre-LN SequenceEncoder, whose block dropout acts
on the attention and FFN outputs (the attention kernels take no dropout).

Model: (item [+ genre]) embeddings as jagged tokens [+ learned positions] ->
input dropout -> causal SequenceEncoder -> user vector at every position
(l2-normalised with --l2norm); logits = user . item / temperature against the
tied item table (l2-normalised with --l2norm; temperature 1 without it), full
softmax over the catalogue or sampled softmax, next-item targets.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from gemjax.data.jagged import pack  # noqa: E402
from gemjax.data.movielens import (DEFAULT_DIR, exclude_history, leave_last_out,  # noqa: E402
                                   load_movielens, ranking_metrics)
from gemjax.layers import SequenceEncoder  # noqa: E402
from gemjax.train.early_stopping import EarlyStopping  # noqa: E402

PUBLISHED = (("SASRec (published)", 0.2853, 0.1603, 0.5474, 0.2185),
             ("HSTU (published)", 0.3097, 0.1720, 0.5754, 0.2307))


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Every knob of a run; flags map one to one (see DEFINE_* below)."""
    max_len: int = 200
    dim: int = 64
    layers: int = 2
    heads: int = 2
    attention: str = "softmax"
    positions: str = "rope"          # "rope" | "learned"
    genre: bool = True
    dropout: float = 0.2             # on the input tokens
    block_dropout: float = 0.0       # inside the encoder blocks
    final_norm: bool = True
    l2norm: bool = False
    temperature: float = 0.05        # used with l2norm only
    loss: str = "full"               # "full" | "sampled"
    negatives: int = 128
    batch_users: int = 128
    lr: float = 1e-3
    adam_b2: float = 0.999
    epochs: int = 100
    eval_every: int = 5
    patience: int = 4
    select: str = "valid"            # "valid" | "fixed"
    refit: bool = True
    time_limit_s: float = 0.0        # 0 = none
    seed: int = 0

    def __post_init__(self):
        for name, value, allowed in (("positions", self.positions, ("rope", "learned")),
                                     ("loss", self.loss, ("full", "sampled")),
                                     ("select", self.select, ("valid", "fixed")),
                                     ("attention", self.attention, ("softmax", "gdpa"))):
            if value not in allowed:
                raise ValueError(f"movielens: {name} must be one of {allowed}, got {value!r}")
        for name in ("max_len", "dim", "layers", "heads", "negatives", "batch_users", "epochs",
                     "eval_every", "patience"):
            if getattr(self, name) < 1:
                raise ValueError(f"movielens: {name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ValueError(f"movielens: temperature must be > 0, got {self.temperature}")


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x [..., d] / max(||x||, eps) along the last axis."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


def sampled_softmax_loss(query, target_emb, negative_emb, target_ids, negative_ids, mask,
                         temperature=1.0):
    """Mean over masked rows of -log softmax([q.e_target, q.e_neg_1..N] / temperature)[0].

    query, target_emb [T, d]; negative_emb [T, N, d]; target_ids [T] and negative_ids
    [T, N] int; mask [T] bool. A negative whose id equals the row's target is left
    out of its softmax. Returns a float32 scalar (0 when no row is masked in).
    """
    q = query.astype(jnp.float32)
    pos = jnp.sum(q * target_emb.astype(jnp.float32), axis=-1) / temperature        # [T]
    neg = jnp.einsum("td,tnd->tn", q, negative_emb.astype(jnp.float32)) / temperature
    neg = jnp.where(negative_ids == target_ids[:, None], -jnp.inf, neg)            # [T, N]
    lse = jnp.logaddexp(pos, jax.nn.logsumexp(neg, axis=-1))
    per_row = jnp.where(mask, lse - pos, 0.0)
    return jnp.sum(per_row) / jnp.maximum(jnp.sum(mask), 1)


class UserTower(nnx.Module):
    """Jagged item ids [T] -> user vectors [T, dim]; scores [.., V] against the item table."""

    def __init__(self, r: Recipe, item_genre: np.ndarray, item_present: np.ndarray, *,
                 rngs: nnx.Rngs):
        self.r = r
        v = len(item_present)
        init = nnx.initializers.normal(0.02)
        self.item = nnx.Embed(v, r.dim, rngs=rngs, embedding_init=init)
        self.genre = (nnx.Embed(int(item_genre.max()) + 1, r.dim, rngs=rngs, embedding_init=init)
                      if r.genre else None)
        self.pos = (nnx.Embed(r.max_len, r.dim, rngs=rngs,
                              embedding_init=nnx.initializers.normal(1 / math.sqrt(r.dim)))
                    if r.positions == "learned" else None)
        self.drop = nnx.Dropout(r.dropout, rngs=rngs)
        self.encoder = SequenceEncoder(r.dim, num_layers=r.layers, num_heads=r.heads,
                                       attention=r.attention, causal=True,
                                       rope=r.positions == "rope", qk_norm=True,
                                       final_norm=r.final_norm, dropout=r.block_dropout,
                                       rngs=rngs)
        self.genre_of = nnx.Variable(jnp.asarray(item_genre, jnp.int32))
        self.present = nnx.Variable(jnp.asarray(item_present, bool))

    def __call__(self, items: jax.Array, jag) -> jax.Array:
        """items [T] int (the jagged values) -> [T, dim] user vectors (unit norm with l2norm)."""
        x = self.item(items)
        if self.genre is not None:
            x = x + self.genre(self.genre_of[...][items])
        if self.pos is not None:        # SASRec: sqrt(d)-scaled items + absolute positions
            pos = jnp.minimum(jnp.asarray(jag.positions), self.r.max_len - 1)
            x = x * math.sqrt(self.r.dim) + self.pos(pos)
        h = self.encoder(self.drop(x), jag)
        return l2_normalize(h) if self.r.l2norm else h

    def item_vectors(self, ids=None) -> jax.Array:
        """The scoring side: item table [V, d] (or rows `ids`), unit norm with l2norm."""
        e = self.item.embedding[...] if ids is None else self.item(ids)
        return l2_normalize(e) if self.r.l2norm else e

    @property
    def inv_temperature(self) -> float:
        return 1.0 / self.r.temperature if self.r.l2norm else 1.0

    def scores(self, h: jax.Array) -> jax.Array:
        """h [N, d] -> logits [N, V]; padding id 0 and absent items at -inf."""
        s = (h @ self.item_vectors().T) * self.inv_temperature
        return jnp.where(self.present[...], s, -jnp.inf)


def next_item_batch(seqs, r: Recipe):
    """B sequences -> (Jagged inputs, targets [T]): inputs = s[:-1], targets = s[1:] of
    each sequence's max_len + 1 most recent items; shorter batches padded with empty samples."""
    cap = r.batch_users * r.max_len
    seqs = [s[max(0, len(s) - r.max_len - 1):].astype(np.int32) for s in seqs]
    seqs += [np.zeros(1, np.int32)] * (r.batch_users - len(seqs))  # -> empty samples
    inp = pack([s[:-1] for s in seqs], capacity=cap)
    tgt = pack([s[1:] for s in seqs], capacity=cap)
    return inp, jnp.asarray(tgt.values)


def loss_fn(model: UserTower, jag, targets, key, present_ids):
    """Mean next-item cross-entropy over the real tokens (full or sampled softmax)."""
    h = model(jnp.asarray(jag.values), jag)                                  # [T, d]
    mask = jag.mask
    if model.r.loss == "full":
        logits = model.scores(h)
        ce = optax.softmax_cross_entropy_with_integer_labels(
            jnp.where(jnp.isfinite(logits), logits, -1e9), targets)
        return jnp.sum(jnp.where(mask, ce, 0.0)) / jnp.maximum(jnp.sum(mask), 1)
    draw = jax.random.randint(key, (h.shape[0], model.r.negatives), 0, present_ids.shape[0])
    neg_ids = present_ids[draw]                                              # [T, N]
    return sampled_softmax_loss(h, model.item_vectors(targets), model.item_vectors(neg_ids),
                                targets, neg_ids, mask, 1.0 / model.inv_temperature)


@functools.lru_cache(maxsize=None)
def adam(lr: float, b2: float) -> optax.GradientTransformation:
    """One optax object per setting, so a refit's optimizer hits the jit cache of train_step."""
    return optax.adam(lr, b2=b2)


@nnx.jit
def train_step(model, opt, jag, targets, key, present_ids):
    loss, grads = nnx.value_and_grad(loss_fn)(model, jag, targets, key, present_ids)
    opt.update(model, grads)
    return loss


@nnx.jit
def last_scores(model, jag):
    h = model(jnp.asarray(jag.values), jag)
    return model.scores(jnp.take(h, jnp.maximum(jag.offsets[1:] - 1, 0), axis=0))


def evaluate(model: UserTower, histories, targets, r: Recipe) -> dict:
    """Full-ranking metrics of the last position: {"masked": {...}, "unmasked": {...}}
    (masked = the history window's items excluded from the ranking, the published protocol)."""
    model.eval()
    cap = r.batch_users * r.max_len
    masked, unmasked = [], []
    for i in range(0, len(histories), r.batch_users):
        chunk = [h[max(0, len(h) - r.max_len):].astype(np.int32)
                 for h in histories[i:i + r.batch_users]]
        n = len(chunk)
        s = np.asarray(last_scores(model, pack(chunk + [np.zeros(1, np.int32)] *
                                               (r.batch_users - n), capacity=cap)))[:n]
        unmasked.append(s)
        masked.append(exclude_history(s, chunk))
    model.train()
    t = np.asarray(targets)
    return {"masked": ranking_metrics(np.concatenate(masked), t, ks=(10, 50)),
            "unmasked": ranking_metrics(np.concatenate(unmasked), t, ks=(10, 50))}


def fit(r: Recipe, ml, seqs, epochs: int, *, seed: int, valid=None, deadline=None, log=print):
    """Train a fresh model on `seqs` for up to `epochs` epochs.

    With valid=(histories, targets): evaluate every r.eval_every epochs, early-stop on
    masked HR@10 (r.patience), restore the best. Stops early past `deadline` (time.time()).
    Returns (model, info {"epochs", "best_epoch", "stopped_by", "history", "epoch_s"}).
    """
    rngs = nnx.Rngs(seed)
    model = UserTower(r, ml.item_genre, ml.item_present, rngs=rngs)
    opt = nnx.Optimizer(model, adam(r.lr, r.adam_b2), wrt=nnx.Param)
    present_ids = jnp.asarray(np.flatnonzero(ml.item_present), jnp.int32)
    seqs = [s for s in seqs if len(s) >= 2]
    rng, key = np.random.default_rng(seed), jax.random.key(seed + 1)
    stopper = EarlyStopping(r.patience) if valid is not None else None
    info = {"epochs": 0, "best_epoch": None, "stopped_by": "epochs", "history": [], "epoch_s": []}
    step = 0
    for epoch in range(1, epochs + 1):
        t0 = time.time()
        order, losses = rng.permutation(len(seqs)), []
        for i in range(0, len(order), r.batch_users):
            jag, targets = next_item_batch([seqs[j] for j in order[i:i + r.batch_users]], r)
            losses.append(train_step(model, opt, jag, targets, jax.random.fold_in(key, step),
                                     present_ids))
            step += 1
        loss = float(np.mean(jax.device_get(losses)))
        info["epoch_s"].append(time.time() - t0)
        info["epochs"] = epoch
        row = {"epoch": epoch, "loss": loss}
        line = f"epoch {epoch}/{epochs}: loss {loss:.4f} ({info['epoch_s'][-1]:.2f}s/epoch)"
        if stopper is not None and (epoch % r.eval_every == 0 or epoch == epochs):
            val = evaluate(model, *valid, r)["masked"]
            row.update(val)
            line += f" valid hr@10 {val['hr@10']:.4f} ndcg@10 {val['ndcg@10']:.4f}"
            before = stopper.best
            stop = stopper.update(val["hr@10"], model)
            if stopper.best != before:
                info["best_epoch"] = epoch
            if stop:
                info["stopped_by"] = "patience"
        info["history"].append(row)
        if epoch % r.eval_every == 0 or epoch == epochs:     # every evaluation falls here too
            log(line, flush=True)
        if info["stopped_by"] == "patience":
            break
        if deadline is not None and time.time() > deadline and epoch < epochs:
            info["stopped_by"] = "time"
            log(f"  time limit reached after epoch {epoch}", flush=True)
            break
    if stopper is not None:
        if info["best_epoch"] is None:      # time ran out before any evaluation
            val = evaluate(model, *valid, r)["masked"]
            stopper.update(val["hr@10"], model)
            info["best_epoch"] = info["epochs"]
        stopper.restore(model)
    return model, info


def run(r: Recipe, ml, users: int, log=print) -> dict:
    """The whole protocol (see the module docstring); returns the results dict."""
    split = leave_last_out(ml, r.max_len)
    test = (split["test"][0][:users], split["test"][1][:users])
    start = time.time()
    out = {"protocol": {"select": r.select, "refit": r.select == "valid" and r.refit,
                        "ranking": "full over present items; `test` excludes the history window"},
           "users": users, "recipe": dataclasses.asdict(r)}
    if r.select == "valid":
        vh, vt = split["valid"]
        deadline = start + r.time_limit_s / 2 if r.time_limit_s else None
        log("select=valid: training on train histories minus their last item", flush=True)
        model, info = fit(r, ml, split["train"][:users], r.epochs, seed=r.seed,
                          valid=(vh[:users], vt[:users]), deadline=deadline, log=log)
        out["select_phase"] = info
        out["best_valid_hr@10"] = max((h["hr@10"] for h in info["history"] if "hr@10" in h),
                                      default=None)
        early = evaluate(model, *test, r)
        out["test_early_stopped"], out["test_early_stopped_unmasked"] = early["masked"], \
            early["unmasked"]
        if r.refit:
            log(f"refit: {info['best_epoch']} epochs on the full train histories", flush=True)
            model, info2 = fit(r, ml, split["train_full"][:users], info["best_epoch"],
                               seed=r.seed, log=log)
            out["refit_phase"] = info2
            res = evaluate(model, *test, r)
            out["test_from"] = "refit"
        else:
            res = early
            out["test_from"] = "early_stopped"
        out["epochs_picked"] = info["best_epoch"]
    else:
        deadline = start + r.time_limit_s if r.time_limit_s else None
        log(f"select=fixed: {r.epochs} epochs on the full train histories", flush=True)
        model, info = fit(r, ml, split["train_full"][:users], r.epochs, seed=r.seed,
                          deadline=deadline, log=log)
        out["fixed_phase"] = info
        out["epochs_picked"] = info["epochs"]
        res = evaluate(model, *test, r)
        out["test_from"] = "fixed"
    out["test"], out["test_unmasked"] = res["masked"], res["unmasked"]
    out["wall_s"] = time.time() - start
    return out


# ----------------------------------------------------------------------------- flags

def define_flags() -> None:
    """The flags (defined only when run as a script, so tests can import this module
    next to other experiments that define flags of the same names)."""
    _D = Recipe()
    flags.DEFINE_string("data_dir", None, "ml-1m directory (default ../shared/datasets/ml-1m)")
    flags.DEFINE_integer("max_len", _D.max_len, "most recent events a model reads")
    flags.DEFINE_integer("dim", _D.dim, "token width (item embedding dim)")
    flags.DEFINE_integer("layers", _D.layers, "sequence encoder blocks")
    flags.DEFINE_integer("heads", _D.heads, "attention heads")
    flags.DEFINE_enum("attention", _D.attention, ["softmax", "gdpa"], "attention kind (causal)")
    flags.DEFINE_enum("positions", _D.positions, ["rope", "learned"],
                      "rope in attention, or learned absolute position embeddings added to the "
                      "sqrt(dim)-scaled item embeddings (positions from the window start)")
    flags.DEFINE_bool("genre", _D.genre, "add a genre embedding to each item token")
    flags.DEFINE_float("dropout", _D.dropout, "dropout on the input tokens")
    flags.DEFINE_float("block_dropout", _D.block_dropout,
                       "dropout on the attention and FFN outputs inside each encoder block")
    flags.DEFINE_bool("final_norm", _D.final_norm, "LayerNorm on the encoder output")
    flags.DEFINE_bool("l2norm", _D.l2norm, "l2-normalise user vectors and the item vectors they "
                      "score, logits = cosine / --temperature")
    flags.DEFINE_float("temperature", _D.temperature, "softmax temperature (with --l2norm only)")
    flags.DEFINE_enum("loss", _D.loss, ["full", "sampled"],
                      "full softmax over the catalogue, or sampled softmax over --negatives "
                      "uniform negatives per position (a negative equal to the target is dropped)")
    flags.DEFINE_integer("negatives", _D.negatives, "negatives per position (--loss=sampled)")
    flags.DEFINE_integer("batch_users", _D.batch_users, "users per training batch")
    flags.DEFINE_float("lr", _D.lr, "Adam learning rate")
    flags.DEFINE_float("adam_b2", _D.adam_b2, "Adam beta2 (generative-recommenders: 0.98)")
    flags.DEFINE_integer("epochs", _D.epochs, "max epochs (select=valid) or epochs (select=fixed)")
    flags.DEFINE_integer("eval_every", _D.eval_every, "epochs between valid evaluations / log lines")
    flags.DEFINE_integer("patience", _D.patience, "evaluations without valid HR@10 gain before stopping")
    flags.DEFINE_enum("select", _D.select, ["valid", "fixed"],
                      "valid: early stopping on the held-out last train item (then --refit); "
                      "fixed: --epochs on the full train histories")
    flags.DEFINE_bool("refit", _D.refit, "select=valid: retrain on the full train histories for the "
                      "picked epochs and report test from that model")
    flags.DEFINE_float("time_limit_s", _D.time_limit_s, "wall-clock cap on training (0 = none); "
                       "select=valid spends at most half of it before the refit")
    flags.DEFINE_integer("limit_users", 0, "use only the first N users (0 = all; for smoke runs)")
    flags.DEFINE_integer("seed", _D.seed, "seed")
    flags.DEFINE_string("out", "runs/movielens/results.json", "JSON results path")


def recipe_from_flags(f) -> Recipe:
    return Recipe(**{k.name: getattr(f, k.name) for k in dataclasses.fields(Recipe)})


def print_table(res: dict, path: str) -> None:
    r = res["recipe"]
    print(f"\nMovieLens-1M test, {res['users']} users, max_len {r['max_len']}, "
          f"test from {res['test_from']} ({res['epochs_picked']} epochs); wrote {path}")
    print(f"{'model':34s} {'HR@10':>7s} {'NDCG@10':>8s} {'HR@50':>7s} {'NDCG@50':>8s}")
    for name, *m in PUBLISHED:
        print(f"{name:34s} " + " ".join(f"{x:{w}.4f}" for x, w in zip(m, (7, 8, 7, 8))))
    for name, key in (("gemjax (history excluded)", "test"),
                      ("gemjax (history kept)", "test_unmasked")):
        t = res[key]
        print(f"{name:34s} {t['hr@10']:7.4f} {t['ndcg@10']:8.4f} {t['hr@50']:7.4f} "
              f"{t['ndcg@50']:8.4f}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    r = recipe_from_flags(f)
    ml = load_movielens(f.data_dir or DEFAULT_DIR)
    users = len(ml.histories) if not f.limit_users else min(f.limit_users, len(ml.histories))
    print(f"{jax.devices()[0].platform}: {users} users, recipe {dataclasses.asdict(r)}", flush=True)
    res = run(r, ml, users)
    os.makedirs(os.path.dirname(os.path.abspath(f.out)), exist_ok=True)
    with open(f.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print_table(res, f.out)


if __name__ == "__main__":
    define_flags()
    app.run(main)
