"""tools/call_gaps.py on CPU (its timing needs a GPU): the split of synthetic perfetto
events into device kernels and host work (busy time and gaps are profile_summary.idle's,
tested in test_profile_summary.py), and the variants' functions."""

import pytest

from tools import call_gaps


def test_split_events_by_process():
    events = [
        dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
        dict(ph="M", name="process_name", pid=2, args=dict(name="/host:CPU")),
        dict(ph="M", name="thread_name", pid=1, tid=7, args=dict(name="Stream #14(Compute)")),
        dict(ph="M", name="thread_name", pid=2, tid=3, args=dict(name="python")),
        dict(ph="X", pid=1, tid=7, ts=20.0, dur=5.0, name="kernel_b"),
        dict(ph="X", pid=1, tid=7, ts=10.0, dur=5.0, name="kernel_a"),
        dict(ph="X", pid=2, tid=3, ts=0.0, dur=30.0, name="PjitFunction(f)"),
        dict(ph="i", pid=2, tid=3, ts=1.0, name="instant: not a span"),
    ]
    dev, host = call_gaps.split_events(events)
    assert [e["name"] for e in dev] == ["kernel_a", "kernel_b"]        # sorted by start
    assert dev[0]["thread"] == "Stream #14(Compute)"
    assert [(e["name"], e["thread"]) for e in host] == [("PjitFunction(f)", "python")]


def test_variants_are_forward_and_train_pairs():
    """Each variant gives (fn(q, k, v), fn(q, k, v, do)); xla_stream returns the output and
    three gradients-shaped arrays, as bench_attention's streaming row does."""
    import jax.numpy as jnp
    x = jnp.ones((128, 1, 64), jnp.bfloat16)
    off = jnp.asarray([0, 100], jnp.int32)
    for spec in ("tiny", "xla_stream"):
        fwd, train = call_gaps.variant_fns(spec, off, off, 0.1)
        assert fwd(x, x, x).shape in ((1,), x.shape)
    o, grads = call_gaps.variant_fns("xla_stream", off, off, 0.1)[1](x, x, x, x)
    assert o.shape == x.shape and len(grads) == 3
    fwd, train = call_gaps.variant_fns("gdpa_triton", off, off, 0.1)
    assert callable(fwd) and callable(train)
