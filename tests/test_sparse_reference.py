"""Independent float64 numpy reference for sharded embedding lookups + sparse optimizers.

It never calls gemjax.sparse: it keeps one logical [V, D] table per name, works
per device on plain per-device id lists, decides capacity overflow by its own
rule (per device, the unique valid ids bound for one owner, smallest first,
beyond the capacity are dropped), and applies the optimizers' formulas with
np.add.at for duplicates.
"""

from __future__ import annotations

import math

import numpy as np


def owner(ids, vocab, split, num_model, num_fs, fixed=None):
    """Model shard owning each logical id (rows split over num_model * num_fs shards).

    fixed: a table_wise table's device (every id goes there).
    """
    if fixed is not None:
        return np.full_like(ids, fixed)
    total = num_model * num_fs
    if split == "mod":
        return (ids % total) // num_fs
    rows = -(-vocab // total)
    return (ids // rows) // num_fs


def capacity(n, num_model, factor, min_capacity):
    if factor is None or num_model == 1:
        return max(n, 1)
    return max(1, min(n, max(min_capacity, math.ceil(factor * n / num_model))))


def kept_mask(dev_ids, vocab, split, num_model, num_fs, cap, fixed=None):
    """dev_ids [n] valid ids of one device -> bool [n], False where overflow drops them."""
    uniq = np.unique(dev_ids)
    own = owner(uniq, vocab, split, num_model, num_fs, fixed)
    kept = set()
    for m in range(num_model):
        kept.update(uniq[own == m][:cap].tolist())
    return np.array([i in kept for i in dev_ids.tolist()], bool)


def sgd(w, st, g, lr):
    return w - lr * g, st


def rowwise_adagrad(w, st, g, lr, eps):
    a = st["accum"] + np.mean(g * g, axis=-1)
    return w - lr * g / (np.sqrt(a)[:, None] + eps), {"accum": a}


def adagrad(w, st, g, lr, eps):
    a = st["accum"] + g * g
    return w - lr * g / (np.sqrt(a) + eps), {"accum": a}


def lazy_adam(w, st, g, lr, b1, b2, eps):
    m = b1 * st["m"] + (1 - b1) * g
    v = b2 * st["v"] + (1 - b2) * g * g
    c = st["count"] + 1
    mh = m / (1 - b1 ** c[:, None])
    vh = v / (1 - b2 ** c[:, None])
    return w - lr * mh / (np.sqrt(vh) + eps), {"m": m, "v": v, "count": c}


def apply_update(table, rows_touched, g_full, update):
    """table {"weights": [V, D], state...}; rows_touched [k] unique; g_full [V, D] summed grads."""
    w = table["weights"][rows_touched]
    st = {k: v[rows_touched] for k, v in table.items() if k != "weights"}
    nw, nst = update(w, st, g_full[rows_touched])
    out = {k: v.copy() for k, v in table.items()}
    out["weights"][rows_touched] = nw
    for k, v in nst.items():
        out[k][rows_touched] = v
    return out


def test_owner_matches_brute_force_assignment():
    """The reference's owner rule equals assigning rows shard by shard."""
    vocab, nm, nf = 37, 4, 2
    rows = -(-vocab // (nm * nf))
    range_owner = np.repeat(np.arange(nm * nf), rows)[:vocab] // nf
    mod_owner = np.array([(i % (nm * nf)) // nf for i in range(vocab)])
    ids = np.arange(vocab)
    assert np.array_equal(owner(ids, vocab, "range", nm, nf), range_owner)
    assert np.array_equal(owner(ids, vocab, "mod", nm, nf), mod_owner)
    kept = kept_mask(np.array([5, 1, 9, 1, 17, 25, 33]), vocab, "mod", nm, nf, 2)
    # mod 8 then //2: 1->0, 5->2, 9->0, 17->0, 25->0, 33->0: model shard 0 keeps 1 and 9 only
    assert kept.tolist() == [True, True, True, True, False, False, False]
