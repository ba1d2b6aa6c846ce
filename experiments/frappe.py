"""Frappe CTR: logistic regression, FM, Wukong and the GEM dense stack, one script.

    python -m experiments.frappe --models=lr,fm,wukong,gem --out=runs/frappe/results.json

Data: ../shared/datasets/frappe (or --data_dir), read in place. Every model trains
on valid.libsvm minus a random --holdout_fraction (early stopping on holdout AUC,
patience --patience epochs, the best epoch's parameters kept) and is scored on
test.libsvm: AUC and log loss (gemjax.train.metrics). Same seed, batches and
optimizer (Adam) for all models.

The same data through the real trainer (gemjax.train.loop.train: sharded embedding
table with row-wise Adagrad, Parquet feed, checkpoints, resume), GEM v0 = Wukong over
the 10 field tokens, preset "frappe" of gemjax/config.py:

    python -m experiments.convert_frappe --out=/tmp/gemjax-data/frappe
    python -m experiments.train --config=frappe --workdir=runs/frappe/gem_s0 --seed=0

It trains on train.parquet for a fixed 180 steps (2 epochs, picked on holdout.parquet)
and evaluates every row of test.parquet: test AUC 0.9454 +- 0.0009, NE 0.400 +- 0.001
over seeds 0, 1, 2 (README "Data"). Converted elsewhere: --features=DIR/schema.json
--override=data.train_path=DIR/train.parquet,data.eval_path=DIR/test.parquet.

Models (all over one shared embedding table of the 5,382 global feature ids):
  lr      sum of per-id weights + bias
  fm      lr + pairwise factorization machine term (dim --fm_dim)
  wukong  [B, F, d] tokens -> Wukong stack -> MLP -> logit
  gem     [B, F, d] tokens -> mixture of Wukong experts (top-k router, cross-layer
          attention, load-balancing loss) -> multi-domain head (one surface, one
          task). Frappe has no event sequences, so this is GEM's non-sequence
          stack; the sequence side is exercised on MovieLens and synthetic data.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags  # noqa: E402

flags.DEFINE_string("data_dir", None, "frappe directory (default ../shared/datasets/frappe)")
flags.DEFINE_list("models", ["lr", "fm", "wukong", "gem"], "models to train")
flags.DEFINE_integer("epochs", 30, "max epochs")
flags.DEFINE_integer("patience", 3, "early-stopping patience in epochs (holdout AUC)")
flags.DEFINE_integer("batch_size", 512, "batch size")
flags.DEFINE_float("lr", 1e-3, "Adam learning rate")
flags.DEFINE_float("emb_l2", 0.0, "L2 penalty on the embeddings of the ids in a batch")
flags.DEFINE_float("dropout", 0.0, "wukong/gem: dropout on the embedding tokens and the head input")
flags.DEFINE_integer("dim", 16, "embedding / token width for wukong and gem")
flags.DEFINE_integer("fm_dim", 16, "FM factor dim")
flags.DEFINE_integer("layers", 3, "Wukong layers")
flags.DEFINE_integer("experts", 4, "gem: Wukong experts")
flags.DEFINE_integer("top_k", 2, "gem: experts per sample")
flags.DEFINE_float("lb_coef", 0.01, "gem: load-balancing loss weight")
flags.DEFINE_float("holdout_fraction", 0.2, "share of valid.libsvm held out for early stopping")
flags.DEFINE_multi_integer("seed", [0], "seeds (repeat the flag for several)")
flags.DEFINE_string("out", "runs/frappe/results.json", "JSON results path")


def build(name, num_features, num_fields, rngs):
    import jax.numpy as jnp
    from flax import nnx

    from gemjax.layers import MLP, MultiDomainHead, Wukong, WukongExperts

    f = flags.FLAGS

    class LR(nnx.Module):
        def __init__(self):
            self.w = nnx.Embed(num_features, 1, embedding_init=nnx.initializers.zeros, rngs=rngs)
            self.b = nnx.Param(jnp.zeros(()))

        def __call__(self, ids):
            return jnp.sum(self.w(ids)[..., 0], -1) + self.b[...], {}

    class FM(LR):
        def __init__(self):
            super().__init__()
            self.v = nnx.Embed(num_features, f.fm_dim, rngs=rngs,
                               embedding_init=nnx.initializers.normal(0.01))

        def __call__(self, ids):
            lin, _ = super().__call__(ids)
            v = self.v(ids)                                          # [B, F, k]
            pair = 0.5 * jnp.sum(jnp.sum(v, 1) ** 2 - jnp.sum(v ** 2, 1), -1)
            return lin + pair, {}

    wk = dict(num_layers=f.layers, fmb_tokens=num_fields // 2 + 1,
              lcb_tokens=num_fields - num_fields // 2 - 1, rank=4, mlp_hidden=(64,))

    class WukongCTR(nnx.Module):
        def __init__(self):
            self.emb = nnx.Embed(num_features, f.dim, rngs=rngs)
            self.drop = nnx.Dropout(f.dropout, rngs=rngs)
            self.wukong = Wukong(num_fields, f.dim, rngs=rngs, **wk)
            self.head = MLP(num_fields * f.dim, (64,), 1, rngs=rngs)

        def __call__(self, ids):
            x = self.wukong(self.drop(self.emb(ids)))
            return self.head(self.drop(x.reshape(x.shape[0], -1)))[:, 0], {}

    class GemCTR(nnx.Module):
        def __init__(self):
            self.emb = nnx.Embed(num_features, f.dim, rngs=rngs)
            self.drop = nnx.Dropout(f.dropout, rngs=rngs)
            self.experts = WukongExperts(num_fields, f.dim, num_experts=f.experts, top_k=f.top_k,
                                         cross_layer_attention=True, cross_layer_heads=2,
                                         rngs=rngs, **wk)
            self.head = MultiDomainHead(num_fields * f.dim, num_surfaces=1, num_tasks=1,
                                        hidden=(64,), rngs=rngs)

        def __call__(self, ids):
            x, aux = self.experts(self.drop(self.emb(ids)))
            surface = jnp.zeros((ids.shape[0],), jnp.int32)
            return self.head(self.drop(x.reshape(x.shape[0], -1)), surface)[:, 0], aux

    return {"lr": LR, "fm": FM, "wukong": WukongCTR, "gem": GemCTR}[name]()


def train_one(name, data, seed):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from gemjax.train.early_stopping import EarlyStopping
    from gemjax.train.metrics import binary_metrics

    f = flags.FLAGS
    model = build(name, data.num_features, data.num_fields, nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.adam(f.lr), wrt=nnx.Param)

    def loss_fn(m, ids, y):
        logits, aux = m(ids)
        loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, y))
        if "load_balance_loss" in aux:
            loss = loss + f.lb_coef * aux["load_balance_loss"]
        if f.emb_l2:
            embs = [e(ids) for e in (getattr(m, a, None) for a in ("emb", "v", "w")) if e is not None]
            loss = loss + f.emb_l2 * sum(jnp.mean(jnp.sum(e ** 2, -1)) for e in embs)
        return loss

    @nnx.jit
    def step(m, o, ids, y):
        loss, grads = nnx.value_and_grad(loss_fn)(m, ids, y)
        o.update(m, grads)
        return loss

    @nnx.jit
    def predict(m, ids):
        return jax.nn.sigmoid(m(ids)[0])

    def evaluate(split):
        model.eval()
        ids, y = split
        bs = 4096
        p = []
        for i in range(0, len(y), bs):
            chunk = ids[i:i + bs]
            pad = bs - len(chunk)
            out = predict(model, jnp.asarray(np.pad(chunk, ((0, pad), (0, 0)))))
            p.append(np.asarray(out)[: len(chunk)])
        model.train()
        return binary_metrics(y, np.concatenate(p))

    ids, y = data.train
    rng = np.random.default_rng(seed)
    nb = len(y) // f.batch_size
    stopper, history = EarlyStopping(f.patience), []
    t0 = time.time()
    for epoch in range(f.epochs):
        perm = rng.permutation(len(y))
        losses = []
        for i in range(nb):
            idx = perm[i * f.batch_size:(i + 1) * f.batch_size]
            losses.append(step(model, opt, jnp.asarray(ids[idx]), jnp.asarray(y[idx])))
        hold = evaluate(data.holdout)
        history.append({"epoch": epoch, "train_loss": float(np.mean(jax.device_get(losses))),
                        "holdout_auc": hold["auc"], "holdout_log_loss": hold["log_loss"]})
        print(f"  {name} seed {seed} epoch {epoch}: loss {history[-1]['train_loss']:.4f} "
              f"holdout auc {hold['auc']:.4f} logloss {hold['log_loss']:.4f}", flush=True)
        if stopper.update(hold["auc"], model):
            break
    stopper.restore(model)
    best = stopper.best
    test = evaluate(data.test)
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {"model": name, "seed": seed, "test_auc": test["auc"], "test_log_loss": test["log_loss"],
            "best_holdout_auc": best, "epochs": len(history), "params": n_params,
            "seconds": time.time() - t0, "history": history}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    unknown = set(f.models) - {"lr", "fm", "wukong", "gem"}
    if unknown:
        raise app.UsageError(f"--models: unknown {sorted(unknown)}")
    import numpy as np

    from gemjax.data.frappe import DEFAULT_DIR, load_frappe

    results = []
    os.makedirs(os.path.dirname(os.path.abspath(f.out)), exist_ok=True)
    for seed in f.seed:
        data = load_frappe(f.data_dir or DEFAULT_DIR, f.holdout_fraction, seed)
        for name in f.models:
            results.append(train_one(name, data, seed))
            with open(f.out, "w") as fh:        # after every model: partial runs keep results
                json.dump({"flags": {k: getattr(f, k) for k in (
                    "models", "epochs", "patience", "batch_size", "lr", "emb_l2", "dropout", "dim",
                    "fm_dim", "layers", "experts", "top_k", "lb_coef", "holdout_fraction", "seed")},
                    "results": results}, fh, indent=1)
    print(f"\nFrappe test (train: valid.libsvm minus {f.holdout_fraction:.0%} holdout), "
          f"{len(f.seed)} seed(s); wrote {f.out}")
    print(f"{'model':8s} {'test AUC':>16s} {'test logloss':>16s} {'epochs':>7s} {'params':>9s}")
    for name in f.models:
        rs = [r for r in results if r["model"] == name]
        a = np.array([r["test_auc"] for r in rs])
        ll = np.array([r["test_log_loss"] for r in rs])
        print(f"{name:8s} {a.mean():9.4f} ±{a.std():.4f} {ll.mean():9.4f} ±{ll.std():.4f} "
              f"{np.mean([r['epochs'] for r in rs]):7.1f} {rs[0]['params']:9d}")


if __name__ == "__main__":
    app.run(main)
