"""EmbeddingCollection(row_major=True) pins the lookup's activations and the gradients
apply_gradients reads to a row-major layout (a LayoutConstraint custom call in the
lowered program), and changes no value: lookups and updated tables equal the
unpinned collection's bit for bit. On 2 H200s the pin took the replica=2 h200 step
from 160.3 to 141.1 ms (docs/performance.md); CPU layouts are row-major anyway, so only the
program text and the values can be checked here.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from gemjax.sparse import SGD, EmbeddingCollection
from gemjax.sparse import plans as plans_lib
import test_sparse_sharded as tss


def make(mesh, plan, row_major):
    specs = tss.make_specs(SGD(lr=0.5))
    return EmbeddingCollection(specs, plans_lib.resolve(plan, specs, mesh, ()), mesh,
                               row_major=row_major)


@pytest.mark.parametrize("plan", ["row_wise", "replicated"])
def test_row_major_pins_layouts_and_keeps_values(plan):
    mesh = tss.mesh_of((4,), ("x",))
    pinned, plain = make(mesh, plan, True), make(mesh, plan, False)
    rng = np.random.default_rng(3)
    tables = {s.name: {"weights": tss.quantized(rng, (s.vocab, s.dim), 64.0)}
              for s in pinned.specs.values()}
    feats = tss.to_global(tss.make_batch(rng, mesh.size), mesh, ("x",))
    states = {c: c.from_logical(tables) for c in (pinned, plain)}
    acts = {c: jax.jit(c.lookup)(states[c], feats) for c in (pinned, plain)}
    n_pin = {c: jax.jit(c.lookup).lower(states[c], feats).as_text().count("LayoutConstraint")
             for c in (pinned, plain)}
    assert n_pin[pinned] >= len(acts[pinned][0]) and n_pin[plain] == 0, n_pin
    for f in acts[plain][0]:
        np.testing.assert_array_equal(np.asarray(acts[pinned][0][f]), np.asarray(acts[plain][0][f]))
    g = {f: jax.device_put(tss.quantized(rng, a.shape, 8.0).astype(np.float32),
                           NamedSharding(mesh, P(("x",)))) for f, a in acts[plain][0].items()}
    for c in (pinned, plain):
        text = jax.jit(c.apply_gradients).lower(states[c], acts[c][1], g).as_text()
        assert ("LayoutConstraint" in text) == c.row_major
        states[c] = jax.jit(c.apply_gradients)(states[c], acts[c][1], g)
    got, want = pinned.to_logical(states[pinned]), plain.to_logical(states[plain])
    for n in want:
        np.testing.assert_array_equal(got[n]["weights"], want[n]["weights"], err_msg=n)
        assert not np.array_equal(want[n]["weights"], tables[n]["weights"]), n
