"""MovieLens-1M next-item prediction with the GEM sequence stack as the user tower.

    python experiments/movielens.py --epochs=100 --out=runs/movielens/results.json
    python experiments/movielens.py --limit_users=300 --max_len=20 --epochs=2   # CPU smoke

Protocol (gemjax.data.movielens): leave-last-out, at most --max_len (200) most
recent events, full ranking over the 3,706 items that occur; HR@10, NDCG@10,
HR@50, NDCG@50 on test, model picked by valid HR@10 (early stopping).
Published (HSTU README, same protocol): SASRec HR@10 0.2853 / NDCG@10 0.1603,
HSTU 0.3097 / 0.1720.

Model: item embeddings (+ genre embedding) packed as jagged tokens -> causal
SequenceEncoder (softmax or GDPA attention, RoPE, QK-norm) -> at every position
a full softmax over the catalogue against the (tied) item embeddings, trained
on next-item targets. The user tower's output at a sample's last event scores
all items at evaluation.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

flags.DEFINE_string("data_dir", None, "ml-1m directory (default ../shared/datasets/ml-1m)")
flags.DEFINE_integer("max_len", 200, "most recent events a model reads")
flags.DEFINE_integer("dim", 64, "token width")
flags.DEFINE_integer("layers", 2, "sequence encoder blocks")
flags.DEFINE_integer("heads", 2, "attention heads")
flags.DEFINE_enum("attention", "softmax", ["softmax", "gdpa"], "attention kind (causal)")
flags.DEFINE_float("dropout", 0.2, "dropout on the input tokens")
flags.DEFINE_integer("batch_users", 128, "users per training batch")
flags.DEFINE_float("lr", 1e-3, "Adam learning rate")
flags.DEFINE_integer("epochs", 100, "max epochs")
flags.DEFINE_integer("eval_every", 5, "epochs between valid evaluations")
flags.DEFINE_integer("patience", 4, "evaluations without valid HR@10 gain before stopping")
flags.DEFINE_integer("limit_users", 0, "use only the first N users (0 = all; for smoke runs)")
flags.DEFINE_integer("seed", 0, "seed")
flags.DEFINE_string("out", "runs/movielens/results.json", "JSON results path")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from gemjax.data.jagged import pack
    from gemjax.data.movielens import DEFAULT_DIR, leave_last_out, load_movielens, ranking_metrics
    from gemjax.layers import SequenceEncoder
    from gemjax.train.early_stopping import EarlyStopping

    ml = load_movielens(f.data_dir or DEFAULT_DIR)
    split = leave_last_out(ml, f.max_len)
    users = len(ml.histories) if not f.limit_users else min(f.limit_users, len(ml.histories))
    v = ml.num_items + 1
    n_genres = int(ml.item_genre.max()) + 1
    rngs = nnx.Rngs(f.seed)

    class UserTower(nnx.Module):
        def __init__(self):
            self.item = nnx.Embed(v, f.dim, rngs=rngs, embedding_init=nnx.initializers.normal(0.02))
            self.genre = nnx.Embed(n_genres, f.dim, rngs=rngs,
                                   embedding_init=nnx.initializers.normal(0.02))
            self.drop = nnx.Dropout(f.dropout, rngs=rngs)
            self.encoder = SequenceEncoder(f.dim, num_layers=f.layers, num_heads=f.heads,
                                           attention=f.attention, causal=True, rope=True,
                                           qk_norm=True, rngs=rngs)

        def __call__(self, items, jag):
            x = self.item(items) + self.genre(genre_table[items])
            return self.encoder(self.drop(x), jag)                          # [T, d]

        def scores(self, h):
            s = h @ self.item.embedding[...].T                              # [.., V]
            return jnp.where(present, s, -jnp.inf)

    genre_table = jnp.asarray(ml.item_genre)
    present = jnp.asarray(ml.item_present)
    model = UserTower()
    opt = nnx.Optimizer(model, optax.adam(f.lr), wrt=nnx.Param)
    cap = f.batch_users * f.max_len

    def batch_of(seqs):
        """Inputs = seq[:-1], targets = seq[1:] (next item at every position)."""
        seqs = [s[max(0, len(s) - f.max_len - 1):] for s in seqs]
        inp = pack([s[:-1].astype(np.int32) for s in seqs], capacity=cap)
        tgt = pack([s[1:].astype(np.int32) for s in seqs], capacity=cap)
        return inp, jnp.asarray(tgt.values)

    def loss_fn(m, jag, targets):
        h = m(jnp.asarray(jag.values), jag)
        logits = m.scores(h)
        ce = optax.softmax_cross_entropy_with_integer_labels(
            jnp.where(jnp.isfinite(logits), logits, -1e9), targets)
        mask = jag.mask
        return jnp.sum(jnp.where(mask, ce, 0.0)) / jnp.maximum(jnp.sum(mask), 1)

    @nnx.jit
    def step(m, o, jag, targets):
        loss, grads = nnx.value_and_grad(loss_fn)(m, jag, targets)
        o.update(m, grads)
        return loss

    @nnx.jit
    def last_scores(m, jag):
        h = m(jnp.asarray(jag.values), jag)
        last = jnp.take(h, jnp.maximum(jag.offsets[1:] - 1, 0), axis=0)     # [B, d]
        return m.scores(last)

    def evaluate(histories, targets):
        model.eval()
        hs, ts = histories[:users], targets[:users]
        all_scores = []
        for i in range(0, len(hs), f.batch_users):
            chunk = [h.astype(np.int32) for h in hs[i:i + f.batch_users]]
            n = len(chunk)
            chunk += [np.zeros(1, np.int32)] * (f.batch_users - n)
            jag = pack(chunk, capacity=cap)
            all_scores.append(np.asarray(last_scores(model, jag))[:n])
        model.train()
        return ranking_metrics(np.concatenate(all_scores), np.asarray(ts), ks=(10, 50))

    train_seqs = [h for h in split["train"][:users] if len(h) >= 2]
    rng = np.random.default_rng(f.seed)
    stopper, history = EarlyStopping(f.patience), []
    t0 = time.time()
    for epoch in range(1, f.epochs + 1):
        order = rng.permutation(len(train_seqs))
        losses = []
        for i in range(0, len(order) - f.batch_users + 1, f.batch_users):
            jag, targets = batch_of([train_seqs[j] for j in order[i:i + f.batch_users]])
            losses.append(step(model, opt, jag, targets))
        if epoch % f.eval_every and epoch != f.epochs:
            continue
        val = evaluate(*split["valid"])
        history.append({"epoch": epoch, "loss": float(np.mean(jax.device_get(losses))), **val})
        print(f"epoch {epoch}: loss {history[-1]['loss']:.4f} valid hr@10 {val['hr@10']:.4f} "
              f"ndcg@10 {val['ndcg@10']:.4f} ({time.time() - t0:.0f}s)", flush=True)
        if stopper.update(val["hr@10"], model):
            break
    stopper.restore(model)
    best = stopper.best
    test = evaluate(*split["test"])
    os.makedirs(os.path.dirname(os.path.abspath(f.out)), exist_ok=True)
    with open(f.out, "w") as fh:
        json.dump({"test": test, "best_valid_hr@10": best, "history": history, "users": users,
                   "flags": {k: getattr(f, k) for k in ("max_len", "dim", "layers", "heads",
                             "attention", "dropout", "batch_users", "lr", "epochs", "seed")}},
                  fh, indent=1)
    print(f"\nMovieLens-1M test, {users} users, max_len {f.max_len}; wrote {f.out}")
    print(f"{'model':24s} {'HR@10':>7s} {'NDCG@10':>8s} {'HR@50':>7s} {'NDCG@50':>8s}")
    for name, hr, nd in (("SASRec (published)", 0.2853, 0.1603), ("HSTU (published)", 0.3097, 0.1720)):
        print(f"{name:24s} {hr:7.4f} {nd:8.4f} {'':>7s} {'':>8s}")
    print(f"{'gemjax ' + f.attention:24s} {test['hr@10']:7.4f} {test['ndcg@10']:8.4f} "
          f"{test['hr@50']:7.4f} {test['ndcg@50']:8.4f}")


if __name__ == "__main__":
    app.run(main)
