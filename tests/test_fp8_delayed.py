"""gemjax.precision.delayed (FP8 with delayed per-tensor scaling) against a float64 reference
of the same recipe, its first step (empty history), saturation, and the history update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemjax.precision.delayed import (fp8_dot_delayed, fp8_dot_delayed_reference, init_history,
                                      saturated_count)
from gemjax.precision.gemm import Recipe


TOL = 2e-5 if jax.default_backend() == "cpu" else 2.0 ** -10


def _data(seed, m=(3, 5), k=40, n=24):
    r = np.random.default_rng(seed)
    x = r.standard_normal(m + (k,)).astype(np.float32)
    w = (r.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    dy = (r.standard_normal(m + (n,)) * 1e-3).astype(np.float32)
    return x, w, dy


def _run(x, w, dy, hist, recipe=Recipe(), margin=0):
    """(y, dx, dw, new hist) of fp8_dot_delayed: the cotangent of hist is the new history."""
    y, vjp = jax.vjp(lambda a, b, h: fp8_dot_delayed(a, b, h, recipe, margin=margin), x, w, hist)
    return (y,) + vjp(jnp.asarray(dy))


def _ref(*args, **kw):
    """fp8_dot_delayed_reference in float64 (x64 on for the call only), as numpy."""
    with jax.enable_x64(True):
        return [np.asarray(t) for t in fp8_dot_delayed_reference(*args, **kw)]


def _close(a, b, mag):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               atol=TOL * float(np.max(mag)), rtol=0)


@pytest.mark.parametrize("margin", [0, 1])
def test_matches_float64_reference_forward_and_backward(margin):
    x, w, dy = _data(0)
    # a history of earlier steps whose max is not this step's amax (scales differ from
    # just-in-time per-tensor ones): x's 20% above, w's 10% below (w clips), dy's equal
    hist = np.zeros((3, 4), np.float32)
    hist[0, 1:3] = [np.abs(x).max() * 1.2, 0.5]
    hist[1, 2] = np.abs(w).max() * 0.9
    hist[2, 0] = np.abs(dy).max()
    y, dx, dw, new = _run(x, w, dy, hist, margin=margin)
    ry, rdx, rdw, rnew = _ref(x, w, dy, hist, margin=margin)
    ax, aw, ady = np.abs(x).reshape(-1, 40), np.abs(w), np.abs(dy).reshape(-1, 24)
    _close(y.reshape(-1, 24), ry.reshape(-1, 24), ax @ aw)
    _close(dx.reshape(-1, 40), rdx.reshape(-1, 40), ady @ aw.T)
    _close(dw, rdw, ax.T @ ady)
    assert rdw.dtype == np.float64
    np.testing.assert_array_equal(np.asarray(new), rnew.astype(np.float32))
    # the quantization is real: the product differs from the float64 unquantized one
    exact = x.reshape(-1, 40).astype(np.float64) @ w.astype(np.float64)
    assert np.max(np.abs(np.asarray(y).reshape(-1, 24) - exact)) > 1e-4


def test_history_update_is_the_cotangent():
    x, w, dy = _data(1)
    hist = np.arange(12, dtype=np.float32).reshape(3, 4) + 1
    *_, new = _run(x, w, dy, hist)
    want = np.concatenate([[[np.abs(x).max()], [np.abs(w).max()], [np.abs(dy).max()]],
                           hist[:, :-1]], axis=1)
    np.testing.assert_array_equal(np.asarray(new), want.astype(np.float32))


def test_first_step_empty_history_uses_scale_one():
    x, w, dy = _data(2)
    hist = init_history(16)
    y, dx, dw, new = _run(x, w, dy, hist)
    # scale 1: x, w round straight to E4M3 and dy (~1e-3) to E5M2, no scaling
    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    xq = np.asarray(jnp.asarray(x).astype(e4).astype(np.float64)).reshape(-1, 40)
    wq = np.asarray(jnp.asarray(w).astype(e4).astype(np.float64))
    dyq = np.asarray(jnp.asarray(dy).astype(e5).astype(np.float64)).reshape(-1, 24)
    _close(np.asarray(y).reshape(-1, 24), xq @ wq, np.abs(xq) @ np.abs(wq))
    _close(np.asarray(dw), xq.T @ dyq, np.abs(xq.T) @ np.abs(dyq))
    assert np.all(np.asarray(new)[:, 1:] == 0) and np.all(np.asarray(new)[:, 0] > 0)
    # the second step's scale comes from the recorded amax: its error is far smaller
    y2, *_ = _run(x, w, dy, new)
    exact = x.reshape(-1, 40).astype(np.float64) @ w.astype(np.float64)
    e1 = np.max(np.abs(np.asarray(y).reshape(-1, 24) - exact))
    e2 = np.max(np.abs(np.asarray(y2).reshape(-1, 24) - exact))
    assert e2 < e1


def test_saturation_clips_and_the_next_scale_covers_it():
    x, w, dy = _data(3)
    x[0, 0, :4] = 1000.0                                        # an amax jump
    hist = np.ones((3, 4), np.float32) * np.float32(4.0)        # scale 4 / 448
    hist[1] = np.abs(w).max()
    hist[2] = np.abs(dy).max()
    y, _, _, new = _run(x, w, dy, hist)
    s = np.float32(4.0) / np.float32(448.0)
    assert int(saturated_count(x, jnp.float32(s), "e4m3")) == 4
    ry, *_ = _ref(x, w, dy, hist)
    _close(np.asarray(y).reshape(-1, 24), np.asarray(ry).reshape(-1, 24),
           np.abs(np.minimum(np.abs(x), 4)).reshape(-1, 40) @ np.abs(w))
    # the clipped row's output: entries 1000 act as 4 (max_finite * s)
    xc = np.clip(x, -4, 4).reshape(-1, 40).astype(np.float64)
    assert abs(float(np.asarray(y).reshape(-1, 24)[0, 0]) - float((xc @ w)[0, 0])) < 0.1 * abs(
        float(((x.reshape(-1, 40) @ w)[0, 0]) - (xc @ w)[0, 0])) + 0.1
    assert float(new[0, 0]) == 1000.0                           # recorded unclipped
    y2, _, _, _ = _run(x, w, dy, new)                           # no clipping next step
    assert int(saturated_count(x, jnp.float32(1000.0 / 448.0), "e4m3")) == 0
    exact = x.reshape(-1, 40).astype(np.float64) @ w.astype(np.float64)
    assert np.max(np.abs(np.asarray(y2).reshape(-1, 24) - exact)) < 0.1 * np.max(np.abs(exact))


def test_bad_history_shape_names_it():
    x, w, _ = _data(4)
    with pytest.raises(ValueError, match="hist"):
        fp8_dot_delayed(x, w, jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="history length"):
        init_history(0)


def _fp8_convert_ancestors(fn, *args):
    """For each float8 convert of fn's jaxpr: the (primitive, size of its first input) it
    depends on, through calls."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    producers = {}

    def walk(jx):
        for e in jx.eqns:
            subs = [p.jaxpr if hasattr(p, "jaxpr") else p for p in e.params.values()
                    if hasattr(p, "eqns") or hasattr(getattr(p, "jaxpr", None), "eqns")]
            for sub in subs:          # map a call's inputs / outputs through its body
                for outer, inner in zip(e.invars, sub.invars):
                    producers[inner] = (("call", 0), [outer])
                walk(sub)
                for outer, inner in zip(e.outvars, sub.outvars):
                    producers[outer] = (("call", 0), [inner])
            if not subs:
                for v in e.outvars:
                    size = int(np.prod(e.invars[0].aval.shape)) if e.invars else 0
                    producers[v] = ((e.primitive.name, size), list(e.invars))
            if (e.primitive.name == "convert_element_type"
                    and "float8" in str(e.params["new_dtype"])):
                stack, seen, names = list(e.invars), set(), set()
                while stack:
                    v = stack.pop()
                    if type(v).__name__ == "Literal" or id(v) in seen or v not in producers:
                        continue
                    seen.add(id(v))
                    name, ins = producers[v]
                    names.add(name)
                    stack += ins
                out.append(names)

    out = []
    walk(jaxpr)
    return out


def test_the_forward_converts_read_no_reduction():
    """The point of delayed scaling: x's and w's FP8 converts depend on no reduction over
    a tensor (only over the 4-entry history; the tensor recipe's do: the check can fail)."""
    from gemjax.precision.gemm import fp8_dot
    x, w, _ = _data(5)
    hist = jnp.ones((3, 4), jnp.float32)
    delayed = _fp8_convert_ancestors(lambda a, b: fp8_dot_delayed(a, b, hist), x, w)
    tensor = _fp8_convert_ancestors(lambda a, b: fp8_dot(a, b, Recipe("tensor")), x, w)
    assert delayed and tensor
    big = lambda names: any(p == "reduce_max" and n > 4 for p, n in names)   # noqa: E731
    assert not any(big(names) for names in delayed)
    assert any(big(names) for names in tensor)
