"""A toy sharded training job (tanh MLP, data parallel + FSDP, optax SGD) for layout tests.

Used by tests/test_parallel_multiprocess.py: the same function runs in one
process with 8 devices and in 2 processes x 4 devices (``launch`` target
"tests.toy_step:train_toy") and must give the same losses and parameters. It
exercises gemjax.parallel alone: mesh from a flag string, params placed by
``rules.param_shardings``, each process feeding its own rows, jit with in/out
shardings.

Model: ``pred = tanh(x @ w1 + b1) @ w2 + b2``, loss = mean((pred - y)^2);
x [B, D] float32, y [B] float32, w1 [D, H], b1 [H], w2 [H, 1], b2 [1].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gemjax.parallel import multihost, rules
from gemjax.parallel.mesh import build_mesh


def toy_data(seed: int, batch: int, dim: int, hidden: int) -> tuple[dict, np.ndarray, np.ndarray]:
    """(params, x, y) as float32 numpy, identical on every process."""
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.normal(0, dim ** -0.5, (dim, hidden)),
        "b1": rng.normal(0, 0.1, (hidden,)),
        "w2": rng.normal(0, hidden ** -0.5, (hidden, 1)),
        "b2": np.zeros((1,)),
    }
    x = rng.normal(size=(batch, dim))
    y = np.sin(x[:, 0]) + 0.1 * rng.normal(size=batch)
    return ({k: v.astype(np.float32) for k, v in params.items()}, x.astype(np.float32), y.astype(np.float32))


def toy_loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    h = rules.with_logical_constraint(h, ("batch", "mlp"))
    pred = (h @ params["w2"] + params["b2"])[:, 0]
    return jnp.mean((pred - y) ** 2)


def train_toy(mesh_specs: list[str], steps: int = 3, seed: int = 0, batch: int = 32, dim: int = 16,
              hidden: int = 24, lr: float = 0.1, momentum: float = 0.9) -> dict:
    """Train ``steps`` SGD-momentum steps on each mesh; {spec: {"losses": [...], "params": {...}}}."""
    out = {}
    params0, x_all, y_all = toy_data(seed, batch, dim, hidden)
    opt = optax.sgd(lr, momentum=momentum)
    for spec in mesh_specs:
        mesh = build_mesh(spec)
        p_sh = rules.param_shardings(params0, mesh)
        params = jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, lambda i: a[i]), params0, p_sh)
        opt_state = opt.init(params)
        o_sh = rules.param_shardings(opt_state, mesh)
        x_sh = rules.logical_sharding(("batch", None), mesh, shape=x_all.shape)
        y_sh = rules.logical_sharding(("batch",), mesh, shape=y_all.shape)
        rows = multihost.process_rows(x_sh, batch)
        x = multihost.put_process_local(x_all[rows], x_sh, batch)
        y = multihost.put_process_local(y_all[rows], y_sh, batch)

        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(toy_loss)(params, x, y)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        step = jax.jit(step, in_shardings=(p_sh, o_sh, x_sh, y_sh), out_shardings=(p_sh, o_sh, None),
                       donate_argnums=(0, 1))
        losses = []
        with jax.set_mesh(mesh):
            for _ in range(steps):
                params, opt_state, loss = step(params, opt_state, x, y)
                losses.append(float(multihost.to_host(loss)))
        out[spec] = {"losses": losses, "params": multihost.to_host(params),
                     "specs": {k: str(v.spec) for k, v in p_sh.items()}, "processes": jax.process_count()}
    return out
