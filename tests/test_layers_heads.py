"""Multi-domain heads against a per-sample float64 numpy version."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.layers.heads import MultiDomainHead
from test_layers_wukong import mlp_np, np64, randomize_params

F, S, K = 6, 3, 2


@pytest.mark.parametrize("towers,gates", [("per_surface", True), ("shared", True),
                                          ("per_surface", False)])
def test_multi_domain_head_matches_numpy(towers, gates):
    m = MultiDomainHead(F, num_surfaces=S, num_tasks=K, hidden=(5,), towers=towers, gates=gates,
                        rngs=nnx.Rngs(0))
    randomize_params(m, 1)
    rng = np.random.default_rng(2)
    h = rng.normal(size=(7, F))
    surface = np.array([0, 2, 1, 1, 0, 2, 2])
    got = np.asarray(nnx.jit(lambda m, h, s: m(h, s))(m, jnp.asarray(h, jnp.float32),
                                                      jnp.asarray(surface)))
    assert got.shape == (7, K)
    for i, s in enumerate(surface):
        hi = h[i] * (2 / (1 + np.exp(-np64(m.gate_logits)[s])) if gates else 1.0)
        if towers == "per_surface":
            want = mlp_np(hi, m.tower[int(s)])
        else:
            want = mlp_np(hi, m.tower).reshape(S, K)[s]
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-5, err_msg=f"sample {i}")


def test_head_gradients_and_bad_surface():
    m = MultiDomainHead(F, num_surfaces=S, num_tasks=K, hidden=(5,), rngs=nnx.Rngs(0))
    h = jnp.asarray(np.random.default_rng(3).normal(size=(6, F)), jnp.float32)
    surface = jnp.array([0, 1, 2, 0, 1, 2])
    grads = nnx.grad(lambda m: jnp.sum(m(h, surface) ** 2))(m)
    for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param)):
        assert float(jnp.abs(g).max()) > 0, jax.tree_util.keystr(path)
    out = m(h, jnp.array([0, 1, 3, 0, -1, 2]))
    assert np.isnan(np.asarray(out)[[2, 4]]).all() and np.isfinite(np.asarray(out)[[0, 1, 3, 5]]).all()
    with pytest.raises(ValueError, match="towers"):
        MultiDomainHead(F, num_surfaces=S, num_tasks=K, towers="mmoe9", rngs=nnx.Rngs(0))
