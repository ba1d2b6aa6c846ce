"""The full GEM teacher: pyramid-parallel sequences -> InterFormer (Wukong / Wukong
experts interaction, GDPA summaries) -> multi-domain heads.

Same contract as models.gem.GEMv0, so the trainer can swap it in:
    GEMTeacher(cfg, rngs=...)(acts, batch) -> logits [B, K] float32

Features: the config's FeatureSchema (gemjax.config.schema_of).
Tokens per sample, each [D] (the inputs from gemjax.layers.inputs):
  x    one per sparse feature (acts[f] [B, D]) + `dense_tokens` from a projection
       of the dense features                                      [B, n, D]
  seq  each event sequence's tokens (sum of its field embeddings, acts
       "<seq>.<field>" [T, D]) -> a PyramidEncoder per sequence (block attention,
       per-block pooling) -> concatenated per sample with type embeddings
  InterFormer(x, seq) -> [x_sum | s_sum] tokens -> flatten -> MultiDomainHead:
  per-surface gate + tower, per-task logits of each sample's own surface.

Experts' router losses: the trainer's loss only sees logits, so the weighted
load-balancing loss is attached to the logits by `attach_aux_loss` (identity in
the forward pass; in the backward pass it adds d(coef * aux)/d(params)), i.e. the
parameters get the gradient of loss + coef * aux. Under the trainer's shard_map
the model runs per batch shard with its batch axes set (`experts.set_mesh_axes`: the
teacher's and its experts' `batch_axes`), so aux is the global-batch figure (psum of
per-shard sums, the same on every shard) and every shard attaches it with weight
coef * experts.aux_loss_scale(logits, batch_axes) = coef / N:
shard_map's backward (check_vma=False) transposes the psum into a psum over the N
shards, so the total gradient is d(coef * aux_global) exactly once, the one-device
gradient (tests/test_sharded_aux_loss.py).

Teacher hyper-parameters are config.ModelConfig fields (TEACHER_FIELDS); the Sequence
Arch self-attention kind is model.attention ("block" | "softmax" | "gdpa").
`teacher_arch(cfg)` resolves them once into a TeacherArch (shapes, token counts, block
names) that the model is built from and that gemjax.perf reads to count and time it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.config import ModelConfig, schema_of
from gemjax.data.batch import Batch
from gemjax.layers import regions
from gemjax.layers.axes import dense_projection
from gemjax.layers.experts import aux_loss_scale
from gemjax.layers.heads import MultiDomainHead
from gemjax.layers.inputs import feature_tokens, num_feature_tokens, sequence_tokens
from gemjax.layers.interformer import InterFormer
from gemjax.layers.pyramid import ParallelPyramid

# Teacher hyper-parameters: config.TeacherConfig fields, model.teacher.<name> (qk_norm and
# rope: model.<name>; defaults documented there).
TEACHER_FIELDS = ("interformer_layers", "summary_tokens", "cls_tokens", "pma_tokens",
                  "recent_tokens", "pyramid_levels", "num_experts", "top_k", "capacity_factor",
                  "cross_layer_attention", "qk_norm", "rope", "lb_coef", "head_towers")

# FFN width multiple of the pyramid's and the InterFormer Sequence Arch's FFNs (the layers'
# ffn_mult default, which the teacher keeps).
FFN_MULT = 2


def _hp(cfg, path):
    """cfg.model.<path> (dotted: "teacher.top_k"); duck-typed configs without the field get
    ModelConfig's default."""
    value, default = cfg.model, ModelConfig()
    for name in path.split("."):
        default = getattr(default, name)
        value = getattr(value, name, default)
    return value


@dataclasses.dataclass(frozen=True)
class TeacherArch:
    """The teacher's architecture, resolved from a config once: GEMTeacher is built from
    it, and the FLOP count (gemjax.perf.model_flops), the Local-MFU blocks
    (gemjax.perf.local_mfu) and the cost model (gemjax.perf.topology) read it.

    Tokens per sample: n = sparse features + dense_tokens feature tokens; the
    Interaction Arch reads n_in = n + seq_summary ([X | S_sum]) and writes n, with
    fmb of them from its FM block and n - fmb from its linear block. The Sequence
    Arch's summaries are cls + pma + recent tokens; the head reads out_tokens x dim.
    levels: ((block, pooled | None, layers), ...) of the pyramid, per sequence.
    """

    dim: int
    heads: int
    dtype: str
    num_dense: int
    dense_tokens: int
    sequences: tuple[str, ...]
    levels: tuple[tuple[int, int | None, int], ...]
    attention: str                # Sequence Arch self-attention: "block" | "softmax" | "gdpa"
    block: int                    # its block size when attention == "block"
    layers: int                   # InterFormer layers
    tokens: int                   # n
    fmb: int
    summary: int                  # m: x_sum tokens
    cls: int
    pma: int
    recent: int
    wukong_layers: int
    wukong_mlp: tuple[int, ...]
    rank: int
    experts: int
    top_k: int
    capacity_factor: float | None
    cross_layer_attention: bool
    rope: bool
    qk_norm: bool
    head_mlp: tuple[int, ...]
    head_towers: str
    surfaces: int
    tasks: int
    lb_coef: float
    ffn_mult: int = FFN_MULT
    ffn_activation: str = "gelu"
    token_bias: bool = True
    norm_impl: str = "xla"

    @property
    def seq_summary(self) -> int:
        """c + p + r: S_sum tokens."""
        return self.cls + self.pma + self.recent

    @property
    def tokens_in(self) -> int:
        """n_in = n + c + p + r: the Interaction Arch's input tokens."""
        return self.tokens + self.seq_summary

    @property
    def lcb(self) -> int:
        return self.tokens - self.fmb

    @property
    def out_tokens(self) -> int:
        """m + c + p + r: [x_sum | s_sum] tokens the head reads."""
        return self.summary + self.seq_summary

    def block_names(self) -> tuple[str, ...]:
        """The teacher's top-level blocks in forward order (the keys of the FLOP count and
        of the Local-MFU layers)."""
        per_layer = tuple(f"interformer{i}.{part}" for i in range(self.layers)
                          for part in ("cross", "interaction", "sequence"))
        return ("inputs", "pyramid") + per_layer + ("final_cross", "head")


def teacher_arch(cfg) -> TeacherArch:
    """cfg's TeacherArch. Pyramid levels: model.teacher.pyramid_levels, or by default two levels of
    model.block tokens (pool each block to 4, then encode only). FM-block tokens:
    model.fmb_tokens when < n, else n // 2."""
    f, m = schema_of(cfg), cfg.model
    block = int(getattr(m, "block", 64))
    n = num_feature_tokens(f, m.dense_tokens)
    return TeacherArch(
        dim=m.dim, heads=m.seq_heads, dtype=m.dtype, num_dense=f.num_dense,
        dense_tokens=m.dense_tokens, sequences=tuple(f.sequence_names),
        levels=tuple(_hp(cfg, "teacher.pyramid_levels") or ((block, 4, 1), (block, None, 1))),
        attention=m.attention, block=block, layers=_hp(cfg, "teacher.interformer_layers"),
        tokens=n, fmb=m.fmb_tokens if m.fmb_tokens < n else n // 2,
        summary=_hp(cfg, "teacher.summary_tokens"),
        cls=_hp(cfg, "teacher.cls_tokens"), pma=_hp(cfg, "teacher.pma_tokens"),
        recent=_hp(cfg, "teacher.recent_tokens"),
        wukong_layers=m.wukong_layers, wukong_mlp=tuple(m.wukong_mlp), rank=m.fm_rank,
        experts=_hp(cfg, "teacher.num_experts"), top_k=_hp(cfg, "teacher.top_k"),
        capacity_factor=_hp(cfg, "teacher.capacity_factor"),
        cross_layer_attention=_hp(cfg, "teacher.cross_layer_attention"), rope=_hp(cfg, "rope"),
        qk_norm=_hp(cfg, "qk_norm"), head_mlp=tuple(m.head_mlp),
        head_towers=_hp(cfg, "teacher.head_towers"),
        surfaces=f.num_surfaces, tasks=f.num_tasks, lb_coef=float(_hp(cfg, "teacher.lb_coef")),
        ffn_activation=_hp(cfg, "teacher.ffn_activation"),
        token_bias=bool(_hp(cfg, "teacher.token_bias")),
        norm_impl=getattr(m, "norm_impl", "xla"))


@jax.custom_vjp
def _attach(x, aux, coef):
    return x


def _attach_fwd(x, aux, coef):
    return x, coef


def _attach_bwd(coef, g):
    return g, jnp.asarray(coef, jnp.float32), jnp.zeros_like(coef)


_attach.defvjp(_attach_fwd, _attach_bwd)


def attach_aux_loss(x: jax.Array, aux: jax.Array, coef: float) -> jax.Array:
    """Returns x; gradients flowing back through x also carry coef * d(aux).

    x any array, aux a scalar; coef >= 0.
    """
    return _attach(x, aux.astype(jnp.float32), jnp.asarray(coef, jnp.float32))


class GEMTeacher(nnx.Module):
    """acts {feature: [B, D] or [T, D]}, Batch -> logits [B, K] (float32).

    Built from ``self.arch`` (TeacherArch). Its blocks, in ``arch.block_names()`` order:
    ``inputs`` (feature tokens), ``pyramid``, per InterFormer layer its ``cross``,
    ``interaction`` and ``sequence`` arches, ``final_cross``, ``head``. Pass ``taps={}`` to
    __call__ to get every block's inputs back in it (see __call__).
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        if not cfg.model.use_sequences:
            raise ValueError("GEMTeacher needs model.use_sequences=True (use GEMv0 without)")
        self.cfg = cfg
        a = self.arch = teacher_arch(cfg)
        dtype = jnp.dtype(a.dtype)
        self.dim, self.dense_tokens, self.dtype = a.dim, a.dense_tokens, dtype
        self.lb_coef = a.lb_coef
        self.batch_axes: tuple[str, ...] = ()    # the shard_map's batch axes (experts.set_mesh_axes)
        self.remat_plan = regions.parse_plan(getattr(getattr(cfg, "train", None), "remat", "none"))
        self.dense_proj = dense_projection(a.num_dense, a.dense_tokens * a.dim, dtype=dtype, rngs=rngs)
        self.pyramid = ParallelPyramid(a.sequences, a.dim, levels=a.levels, num_heads=a.heads,
                                       ffn_mult=a.ffn_mult, ffn_activation=a.ffn_activation,
                                       use_bias=a.token_bias, dtype=dtype,
                                       norm_impl=a.norm_impl, rngs=rngs)
        self.interformer = InterFormer(
            a.tokens, a.dim, num_layers=a.layers, num_heads=a.heads,
            summary_tokens=a.summary, cls_tokens=a.cls, pma_tokens=a.pma, recent_tokens=a.recent,
            mlp_hidden=a.wukong_mlp, wukong_layers=a.wukong_layers, fmb_tokens=a.fmb,
            rank=a.rank, cross_layer_attention=a.cross_layer_attention,
            num_experts=a.experts, top_k=a.top_k, capacity_factor=a.capacity_factor,
            seq_attention=a.attention, block=a.block, rope=a.rope, qk_norm=a.qk_norm,
            ffn_mult=a.ffn_mult, ffn_activation=a.ffn_activation, dtype=dtype, rngs=rngs)
        self.head = MultiDomainHead(self.interformer.out_tokens * a.dim, num_surfaces=a.surfaces,
                                    num_tasks=a.tasks, hidden=a.head_mlp,
                                    towers=a.head_towers, dtype=dtype, rngs=rngs)
        regions.set_plan(self, self.remat_plan)      # the teacher's and InterFormer's regions

    def inputs(self, acts: dict[str, jax.Array], dense: jax.Array, sequences: dict):
        """The ``inputs`` block: -> (x [B, n, D] feature tokens, {seq: (tokens [T, D], jagged)}),
        a sequence's tokens the sum of its field embeddings."""
        # fields summed in float32 (bf16 rows, sparse.act_dtype=model, round once)
        f = schema_of(self.cfg)
        x = feature_tokens(acts, dense, f, self.dense_proj, dense_tokens=self.dense_tokens,
                           width=self.dim, dtype=self.dtype)
        return x, sequence_tokens(acts, sequences, f, self.dtype)

    def __call__(self, acts: dict[str, jax.Array], batch: Batch, taps: dict | None = None) -> jax.Array:
        """taps: None, or a dict this call fills with the blocks' inputs: "x" [B, n, D],
        "seqs" {seq: (tokens, jagged)}, "seq" [T, D] and "jagged" (the pyramid's output),
        InterFormer.__call__'s taps ("layers", "final"), "summary" [B, F].

        Activation checkpointing: the regions run under ``self.remat_plan`` (the parse of
        train.remat, gemjax.layers.regions; set on the InterFormer's modules too, by
        regions.set_plan); "none" wraps nothing."""
        b = batch.dense.shape[0]
        x, seqs = self.inputs(acts, batch.dense, batch.sequences)
        seq, jag = regions.run(self.remat_plan, "pyramid", self.pyramid, seqs)
        if taps is not None:
            taps.update(x=x, seqs=seqs, seq=seq, jagged=jag)
        summary, aux = self.interformer(x, seq, jag, taps=taps)
        summary = summary.reshape(b, -1)
        if taps is not None:
            taps["summary"] = summary
        logits = regions.run(self.remat_plan, "heads", self.head, summary, batch.surface)
        if "load_balance_loss" in aux and self.lb_coef:
            logits = attach_aux_loss(logits, aux["load_balance_loss"],
                                     self.lb_coef * aux_loss_scale(logits, self.batch_axes))
        return logits
