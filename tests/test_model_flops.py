"""Analytic teacher FLOPs (gemjax.perf.model_flops) against XLA's CPU count, block by block.

Method. Each block of local_mfu.teacher_blocks is compiled forward only (its vjp
with the backward's outputs dropped, which XLA removes) with every kernels/
attention op swapped for a FLOP-free stand-in that still reads q, k and v (so
XLA keeps their projections): the jnp reference attention computes padded
rectangles, the analytic count valid pairs, so the two cannot be compared in one
number. The pyramid's pooling is routed through its kernel call (as on GPU) so
it is swapped too. Then, per block:

- attention: the stand-ins record 4 H D x valid pairs of every call from its
  concrete offsets in an eager run of the block; the sum must equal the
  analytic attention term exactly;
- the rest: the analytic matmul term of the padded program (``capacities`` =
  the batch's static buffers, which is what XLA compiles) must equal the FLOPs
  of the dot ops in XLA's optimised HLO exactly, and lie below XLA's whole cost
  analysis; on the widened variants (dim 128, where a d -> d projection's 2 d
  FLOPs per output element dominate) XLA's whole count may exceed it by at most
  ELEMENTWISE_TOL: XLA adds element-wise work (LayerNorm ~8 FLOPs per element,
  GELU, RoPE, residual adds, biases, masks, router softmax, expert gating).
  Measured at dim 128: 2-7% for the attention / cross / head blocks, 10.4% for
  a one-layer Wukong interaction (its FM contracts over rank 4 and a few tokens
  only, so its LayerNorm over n k, biases and ReLU weigh more); at dim 64 the
  pyramid reaches 14%. The tiny preset itself (dim 8) gets only the exact dot
  check: there a norm costs about as much as a projection (XLA 1.1-2.2x). The
  inputs block is element-wise by design (the sequence field sums, 5x its one
  matmul) and gets the exact dot check only.

The model count (valid tokens, top_k experts) is checked against XLA on a batch
with no padding anywhere (tight buffers, no pooling, top_k = num_experts), where
it must equal the padded count, and for additivity over samples.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.config import get_config, schema_of
from gemjax.data.jagged import Jagged
from gemjax.data.synthetic import SEQUENCES, SyntheticStream
from gemjax.perf import local_mfu as L
from gemjax.perf import mfu as M
from gemjax.perf import model_flops as F

ELEMENTWISE_TOL = 0.15

_BASE = "model.kind=teacher"
_WIDE = _BASE + ",model.dim=128,model.interformer_layers=1"
VARIANTS = {
    # the tiny preset as it is: block attention, 2 InterFormer layers, one Wukong layer
    "tiny": _BASE,
    # experts with drops (C = 48 < B), softmax self-attention, Wukong cross-layer attention,
    # several blocks per sample
    "experts_softmax": _WIDE + ",model.seq_heads=2,model.num_experts=4,model.top_k=2,"
                       "model.capacity_factor=1.5,model.attention=softmax,model.wukong_layers=2,"
                       "model.block=8",
    # GDPA self-attention, three pyramid levels (one without layers), shared head towers,
    # no PMA
    "gdpa_levels": _WIDE + ",model.seq_heads=4,model.attention=gdpa,"
                   "model.pyramid_levels=4:2:1/3:2:0/8:none:1,model.head_towers=shared,"
                   "model.pma_tokens=0",
}

# ----------------------------------------------------------------------------- helpers

_INSTR = re.compile(r"%([\w.\-]+) = \w+\[([\d,]*)\]\S* ([\w\-]+)\(([^)]*)\)(.*)")


def hlo_dot_flops(hlo: str) -> int:
    """FLOPs of the dot ops of an optimised HLO module: 2 x output elements x contraction.

    Every instruction's shape is read from its definition (names are unique in a
    module); a convolution (which XLA could turn a dot into) fails loudly.
    """
    shapes, total = {}, 0
    for line in hlo.splitlines():
        mt = _INSTR.search(line)
        if not mt:
            continue
        name, dims, op, operands, rest = mt.groups()
        shapes[name] = [int(x) for x in dims.split(",") if x]
        assert op != "convolution", f"a convolution in the HLO, not counted: {line.strip()}"
        if op == "dot":
            lhs = operands.split(",")[0].strip().lstrip("%")
            contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
            k = math.prod(shapes[lhs][int(i)] for i in contract.split(",") if i)
            total += 2 * math.prod(shapes[name]) * k
    return total


def test_hlo_dot_flops_is_xla_cost_of_matmuls():
    x, w, y = jnp.ones((4, 6, 8)), jnp.ones((8, 16)), jnp.ones((6, 3))

    def f(x, w, y):   # a batched / transposed contraction and a plain one, nothing else
        return jnp.einsum("bnd,nk->bdk", x, y), x.reshape(-1, 8) @ w

    c = jax.jit(f).lower(x, w, y).compile()
    assert hlo_dot_flops(c.as_text()) == M.compiled_flops(c) == 2 * 4 * 6 * 8 * 3 + 2 * 24 * 8 * 16


def _stub_kernels(monkeypatch) -> list[int]:
    """Swap the attention ops the layers call for FLOP-free stand-ins; returns the list
    each call appends its 4 H D x valid pairs to when the compiled program runs (a
    host callback gets the concrete offsets)."""
    import gemjax.layers.attention as A
    import gemjax.layers.pyramid as P
    recorded: list[int] = []

    def make(op):
        def stub(q, k, v, q_off, *rest, **kw):
            kv_off = rest[0] if rest else q_off
            h, d = q.shape[1], q.shape[2]
            causal, window = kw.get("causal", False), kw.get("window")
            block = kw.get("block") if op == "block" else None
            jax.debug.callback(lambda qo, ko: recorded.append(M.attention_flops(
                np.diff(qo), np.diff(ko), heads=h, head_dim=d, causal=causal, window=window,
                block=block)), q_off, kv_off)
            return q + (jnp.mean(k, axis=0) + jnp.mean(v, axis=0)).astype(q.dtype)[None]
        return stub

    for op, name in (("gdpa", "gdpa"), ("softmax", "jagged_attention"), ("block", "block_attention")):
        monkeypatch.setattr(A, name, make(op))
    # pool through the kernel call, as where kernels run in Pallas (PyramidLevel.pools_in_kernel)
    monkeypatch.setattr(P, "default_impl", lambda op, head_dim, backend=None: "pallas")
    return recorded


def _tight(batch):
    """The batch with every sequence's capacity cut to its tokens (no padding rows)."""
    seqs = {}
    for s, j in batch.sequences.items():
        n = int(np.asarray(j.offsets)[-1])
        seqs[s] = Jagged({f: v[:n] for f, v in j.values.items()}, j.offsets, j.segment_ids[:n],
                         j.positions[:n])
    return batch.replace(sequences=seqs)


def _check_blocks(cfg, batch, monkeypatch, capacities, tol=None):
    """Per block: recorded attention == analytic, XLA dot FLOPs == analytic matmul <=
    XLA's whole count (<= (1 + tol) x analytic where tol is given, inputs excepted)."""
    from gemjax.models.gem import build_model
    recorded = _stub_kernels(monkeypatch)
    lens = {s: np.diff(np.asarray(batch.sequences[s].offsets)) for s in SEQUENCES}
    want = F.teacher_block_detail(cfg, lens, capacities)
    dev = jax.device_put(batch)
    model = build_model(cfg, nnx.Rngs(0))
    blocks = L.teacher_blocks(model, L.random_acts(cfg, dev, jax.random.key(1)), dev)
    assert [b.name for b in blocks] == list(want)
    rows = {}
    for blk in blocks:
        compiled = jax.jit(lambda *a, f=blk.fn: f(*a)[0]).lower(*blk.args).compile()   # forward only
        recorded.clear()
        jax.block_until_ready(compiled(*blk.args))
        jax.effects_barrier()                                 # every callback has run
        attention = sum(recorded)
        rows[blk.name] = (attention, hlo_dot_flops(compiled.as_text()), M.compiled_flops(compiled))
    for name, (attention, dots, xla) in rows.items():
        a = want[name]
        assert attention == a.attention, (name, attention, a.attention)
        assert dots == a.matmul, (name, dots, a.matmul)
        assert a.matmul <= xla, (name, a.matmul, xla)
        if tol is not None and name != "inputs":
            assert xla <= (1 + tol) * a.matmul, (name, xla / a.matmul)
    return want, rows


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_blocks_match_xla(variant, monkeypatch):
    cfg = get_config("tiny", VARIANTS[variant])
    batch, _ = SyntheticStream(cfg.data, 0).shard_batch(0, 0, 1)
    caps = {s: batch.sequences[s].capacity for s in SEQUENCES}
    want, rows = _check_blocks(cfg, batch, monkeypatch, caps,
                               tol=None if variant == "tiny" else ELEMENTWISE_TOL)
    assert all(want[n].attention > 0 for n in want if n.endswith(".sequence") or n == "pyramid")
    # the padded program does more than the model: padding rows, dispatch slots
    lens = {s: np.diff(batch.sequences[s].offsets) for s in SEQUENCES}
    model = F.teacher_block_flops(cfg, lens)
    assert all(model[n] <= want[n].total for n in want)
    assert model["pyramid"] < want["pyramid"].total
    if cfg.model.teacher.num_experts:      # 2 of 4 experts per sample vs 4 x 48 slots for 64 samples
        inter = want["interformer0.interaction"].matmul
        assert model["interformer0.interaction"] < 0.75 * inter


def test_model_count_on_a_batch_without_padding(monkeypatch):
    """No padding anywhere (tight buffers, no pooling, every expert runs): the model
    count equals the padded program's, and XLA's."""
    cfg = get_config("tiny", _BASE + ",model.interformer_layers=1,model.num_experts=2,"
                     "model.top_k=2,model.pyramid_levels=8:none:1,model.wukong_layers=2")
    batch = _tight(SyntheticStream(cfg.data, 0).shard_batch(0, 0, 1)[0])
    lens = {s: np.diff(batch.sequences[s].offsets) for s in SEQUENCES}
    caps = {s: batch.sequences[s].capacity for s in SEQUENCES}
    assert caps == {s: int(v.sum()) for s, v in lens.items()}
    model = F.teacher_block_detail(cfg, lens)
    assert model == F.teacher_block_detail(cfg, lens, caps)
    _check_blocks(cfg, batch, monkeypatch, None)


def _lens(cfg, step=0):
    batch, _ = SyntheticStream(cfg.data, 0).shard_batch(step, 0, 1)
    return {s: np.diff(batch.sequences[s].offsets) for s in SEQUENCES}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_step_is_three_forwards_and_linear_in_the_batch(variant):
    cfg = get_config("tiny", VARIANTS[variant])
    a, b = _lens(cfg, 0), _lens(cfg, 1)
    blocks = F.teacher_block_flops(cfg, a)
    step = F.teacher_step_flops(cfg, a)
    assert step == 3 * sum(blocks.values()) > 0
    assert list(blocks) == ["inputs", "pyramid"] + [
        f"interformer{i}.{p}" for i in range(cfg.model.teacher.interformer_layers)
        for p in ("cross", "interaction", "sequence")] + ["final_cross", "head"]
    # doubling the batch (every sample twice) doubles every block; two batches add up
    doubled = {s: np.concatenate([a[s], a[s]]) for s in SEQUENCES}
    assert F.teacher_block_flops(cfg, doubled) == {k: 2 * v for k, v in blocks.items()}
    assert F.teacher_step_flops(cfg, doubled) == 2 * step
    both = {s: np.concatenate([a[s], b[s]]) for s in SEQUENCES}
    assert F.teacher_step_flops(cfg, both) == step + F.teacher_step_flops(cfg, b) != 2 * step
    # and per sample: the model count is additive over samples (no static bound in it)
    per = [F.teacher_step_flops(cfg, {s: a[s][i:i + 1] for s in SEQUENCES}) for i in range(8)]
    assert F.teacher_step_flops(cfg, {s: a[s][:8] for s in SEQUENCES}) == sum(per)


def test_attention_term_is_the_kernel_calls():
    """The attention term is exactly attention_calls' valid pairs (with the
    pyramid pooling on every backend: the calls it lists where pooling runs in Pallas)."""
    cfg = get_config("tiny", VARIANTS["gdpa_levels"])
    lens = _lens(cfg)
    det = F.teacher_block_detail(cfg, lens)
    want: dict[str, int] = {}
    for c in F.attention_calls(cfg, lens, backend="gpu"):     # head dim 16: all in Pallas there
        want[c.block] = want.get(c.block, 0) + c.forward_flops
    assert {k: v.attention for k, v in det.items() if v.attention} == want
    assert "interformer0.cross" not in want            # no PMA in this variant


def test_errors():
    lens = {s: np.array([3, 0, 5]) for s in SEQUENCES}
    for kind in ("gem", "lr"):
        with pytest.raises(ValueError, match="model.kind must be 'teacher'"):
            F.teacher_block_flops(get_config("tiny", f"model.kind={kind}"), lens)
    cfg = get_config("tiny", _BASE)
    with pytest.raises(ValueError, match="lacks sequences"):
        F.teacher_step_flops(cfg, {SEQUENCES[0]: lens[SEQUENCES[0]]})
    with pytest.raises(ValueError, match="one B"):
        F.teacher_step_flops(cfg, {**lens, SEQUENCES[0]: np.array([1, 2])})
    with pytest.raises(ValueError, match="capacity"):
        F.teacher_step_flops(cfg, lens, capacities={s: 4 for s in SEQUENCES})


def test_batch_of_shards_and_cli(capsys):
    from gemjax.data.feeding import concat_shards
    cfg = get_config("tiny", _BASE + ",model.num_experts=2")
    stream = SyntheticStream(cfg.data, 0)
    shards = [stream.shard_batch(0, i, 2)[0] for i in range(2)]
    host = concat_shards(shards)
    per = [{s: np.diff(b.sequences[s].offsets) for s in SEQUENCES} for b in shards]
    assert F.batch_step_flops(cfg, host, 2) == sum(F.teacher_step_flops(cfg, lens) for lens in per)
    padded = F.batch_block_detail(cfg, host, 2)["padded"]["pyramid"]
    want = [F.teacher_block_detail(cfg, lens, {s: b.sequences[s].capacity for s in SEQUENCES})["pyramid"]
            for lens, b in zip(per, shards)]
    assert padded.total == sum(w.total for w in want)
    F.main(["--config=tiny", "--override=model.kind=teacher,model.num_experts=2"])
    out = capsys.readouterr().out
    step = F.teacher_step_flops(cfg, _lens(cfg))
    assert "interformer1.interaction" in out and f"{step * 1e-9:.2f} GFLOP model" in out


# The analytic counts of three configs, pinned (computed before the count read the teacher's
# TeacherArch; model_flops re-derives every shape from it now): {block: (matmul, attention)}
# of the model count, and the padded program's total, on fixed lengths of 16 samples.
PINNED = {
    ("tiny", "model.kind=teacher"): (
        {"inputs": (2048, 0), "pyramid": (7453440, 6254816), "interformer0.cross": (259072, 45312),
         "interformer0.interaction": (116224, 0), "interformer0.sequence": (1120256, 808448),
         "interformer1.cross": (259072, 45312), "interformer1.interaction": (116224, 0),
         "interformer1.sequence": (1120256, 808448), "final_cross": (259072, 45312), "head": (100352, 0)},
        19940064),
    ("h200", "model.kind=teacher,model.num_experts=4,model.top_k=2"): (
        {"inputs": (65536, 0), "pyramid": (1804533760, 168947200), "interformer0.cross": (88604672, 401408),
         "interformer0.interaction": (545202176, 0), "interformer0.sequence": (162529280, 6766592),
         "interformer1.cross": (88604672, 401408), "interformer1.interaction": (545202176, 0),
         "interformer1.sequence": (162529280, 6766592), "final_cross": (88604672, 401408),
         "head": (50397184, 0)},
        5009034752),
    ("small", "model.kind=teacher,model.attention=gdpa,model.pyramid_levels=16:2:1/8:2:0/16:none:1,"
              "model.head_towers=shared,model.num_experts=3,model.top_k=2,model.capacity_factor=1.5,"
              "model.cls_tokens=0,model.interformer_layers=3"): (
        {"inputs": (4096, 0), "pyramid": (28564480, 5973312), "interformer0.cross": (659456, 25088),
         "interformer0.interaction": (2524672, 0), "interformer0.sequence": (1069056, 211456),
         "interformer1.cross": (659456, 25088), "interformer1.interaction": (2524672, 0),
         "interformer1.sequence": (1069056, 211456), "interformer2.cross": (659456, 25088),
         "interformer2.interaction": (2524672, 0), "interformer2.sequence": (1069056, 211456),
         "final_cross": (659456, 25088), "head": (540672, 0)},
        58736448),
}


@pytest.mark.parametrize("preset,overrides", list(PINNED))
def test_counts_of_three_presets_are_pinned(preset, overrides):
    from gemjax.models.interformer import teacher_arch
    cfg = get_config(preset, overrides)
    rng = np.random.default_rng(7)
    lens = {s: rng.integers(0, 300, size=16) for s in schema_of(cfg).sequence_names}
    caps = {s: int(v.sum()) + 64 for s, v in lens.items()}
    model, padded = PINNED[(preset, overrides)]
    got = F.teacher_block_detail(cfg, lens)
    assert {k: (v.matmul, v.attention) for k, v in got.items()} == model
    assert tuple(got) == teacher_arch(cfg).block_names()
    assert sum(v.total for v in F.teacher_block_detail(cfg, lens, caps).values()) == padded
