"""pallas_call plumbing shared by the Triton forward and backward: block specs (whole
arrays, one head per program), the fixed order of the kernels' refs, compiler params."""

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def full_spec(shape):
    """BlockSpec of a whole array, the same block for every program."""
    nd = len(shape)
    return pl.BlockSpec(shape, lambda *_: (0,) * nd)


def in_specs(cfg, tq, tk, d, ntile):
    """In-specs for (layout..., cos/sin..., q, k, v): whole arrays, one head per program.

    Every kernel picks its own rows with pl.ds from the tile order (perm), so the
    specs are the same for the forward, dQ and dK/dV calls.
    """
    hd = d // 2
    lay = ([full_spec((tq,)), full_spec((tq,)), full_spec((tk,)), full_spec((tk,))]
           + [full_spec((ntile,))] * 5)
    cs = [full_spec((tq, hd))] * 2 + [full_spec((tk, hd))] * 2 if cfg.rope else []
    return lay + cs + [head_spec(tq, d), head_spec(tk, d), head_spec(tk, d)]


def head_spec(t, d):
    """BlockSpec of a [T, H, D] array: program (i, j) sees head j as a [T, D] view."""
    return pl.BlockSpec((t, None, d), lambda i, j: (0, j, 0))


def stat_spec(t):
    """BlockSpec of an [H, T] per-row statistic (lse, delta): head j's [T] row."""
    return pl.BlockSpec((None, t), lambda i, j: (j, 0))


def ordered_refs(kernel, cfg, n_in_extra, has_stats, n_out):
    """Kernel taking refs in a fixed order; absent rope tables / softmax stats -> None.

    has_stats: None (the kernel has no stats inputs), False (passed as None), True.
    """
    def wrapped(*refs):
        refs = list(refs)
        lay, refs = refs[:9], refs[9:]
        if cfg.rope:
            cs, refs = refs[:4], refs[4:]
        else:
            cs = [None] * 4
        qkv, refs = refs[:3], refs[3:]
        extra, refs = refs[:n_in_extra], refs[n_in_extra:]
        if has_stats:
            stats, refs = refs[:2], refs[2:]
        else:
            stats = [] if has_stats is None else [None, None]
        outs = refs
        assert len(outs) == n_out, (len(outs), n_out)
        return kernel(*lay, *cs, *qkv, *extra, *stats, *outs, cfg=cfg)
    return wrapped


def compiler_params(cfg, bwd):
    """Triton warps / stages of the forward (bwd False) or of the backward kernels."""
    if bwd:
        return plgpu.CompilerParams(num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd)
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def layout_inputs(lay, q, k, v, over_q):
    """The pallas_call inputs in in_specs' order: each row's sample and position (queries,
    keys), the launch order and tile ranges of the query tiles (over_q) or of the key
    tiles, the RoPE tables (if any), q, k, v."""
    side = "q" if over_q else "k"
    xs = [lay["qs"], lay["qp"], lay["ks"], lay["kp"], lay[side + "_perm"], lay[side + "_lo"],
          lay[side + "_hi"], lay[side + "_flo"], lay[side + "_fhi"]]
    if lay["cos"] is not None:
        xs += [lay["cos"], lay["sin"], lay["cos"], lay["sin"]]
    return xs + [q, k, v]
