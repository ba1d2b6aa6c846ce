"""Configs: the dataclasses of a run, overridable field by field at any depth.

    cfg = get_config("small", overrides="data.batch_size=512,model.dim=32")
    cfg = config_from_dict(json.load(open("runs/x/config.json")))   # a run's config back

The named presets are defined in gemjax.presets, which fills PRESETS here on import
(gemjax/__init__.py imports it); this module imports only gemjax.features.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from typing import Any

from gemjax.features import EventField, FeatureSchema, SequenceFeature, SparseFeature, Table


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The data source (gemjax.data.source.make_source) and its settings.

    source "synthetic": the planted-teacher stream (gemjax.data.synthetic), shaped by
    the fields below from num_surfaces on. source "parquet": the user's files
    (gemjax.data.parquet), laid out by Config.features (required); train_path and
    eval_path are each a file, a directory (its *.parquet files) or a glob; the train
    stream reads in `order` ("shuffle": seeded row-group permutation plus an in-memory
    window of shuffle_window rows; "time": file order), the eval stream in file order,
    eval_batches batches (0: the whole eval data once). `nan`: a NaN / null dense value
    is an error ("error") or 0, counted nan_filled in metrics.jsonl ("zero").
    batch_size, capacity_slack, eval_batches, host_workers and recent apply to both.
    """

    batch_size: int = 512            # global samples per step
    source: str = "synthetic"        # "synthetic" | "parquet"
    train_path: str = ""             # parquet: file, directory or glob of the training rows
    eval_path: str = ""              # parquet: file, directory or glob of the eval rows
    # validation rows of model selection (train.select_metric): parquet: a file, directory or
    # glob, a bare file name meaning that file in data.train_path's directory (the converters
    # write valid.parquet / holdout.parquet beside train.parquet); synthetic: "synthetic" (or
    # a preset's bare file name) selects the held-out synthetic stream, seeded apart from the
    # train and eval streams
    valid_path: str = ""
    order: str = "shuffle"           # parquet train stream: "shuffle" | "time"
    shuffle_window: int = 65_536     # parquet: rows of the in-memory shuffle window
    nan: str = "error"               # parquet: NaN / null dense values: "error" | "zero"
    # parquet: bound on the magnitude of finite dense values (0: none); beyond it a value is
    # an error naming file, row and column (nan="error") or clamped, counted dense_clamped
    dense_max_abs: float = 0.0
    # parquet: resume although the train files differ from WORKDIR/train_files.json (the
    # files the run started with); the change is logged and recorded there
    accept_changed_files: bool = False
    num_surfaces: int = 2        # synthetic: surfaces (e.g. feed, video), each with its own head
    num_tasks: int = 2           # synthetic: tasks (labels) per sample, e.g. click and conversion
    vocab_user: int = 100_000        # user ids: Zipf, no direct signal (too many to learn)
    vocab_segment: int = 200         # user segment: first-order + FM signal
    vocab_context: int = 50          # context: first-order + FM signal
    vocab_item: int = 4_000          # items (candidate and events); category = item % num_categories
    num_categories: int = 8      # synthetic: item categories
    num_event_types: int = 4     # synthetic: event types of the sequences
    num_dense: int = 4           # synthetic: dense features
    zipf: float = 1.05           # synthetic: Zipf exponent of id popularity
    seq_median: float = 32.0         # log-normal sequence lengths
    seq_sigma: float = 0.8       # log-sigma of the sequence lengths
    seq_cap: int = 256               # longer sequences keep their most recent events (counted)
    recent: int = 32                 # the teacher's recency window over sequences
    capacity_slack: float = 1.3      # packed capacity = slack * expected tokens per batch
    eval_batches: int = 16       # eval batches (0: the whole eval data once)
    host_workers: int = 1            # Feeder threads: each builds, checks and device_puts (step, shard) pieces
    # parquet train stream of positives only: N negatives per row drawn each epoch as a pure
    # function of (train.seed, epoch, row) by gemjax.data.negatives (0: rows as stored);
    # data.batch_size counts all rows (a multiple of 1 + N). negatives_path: the sampler's
    # .npz ("": negatives.npz beside data.train_path)
    negatives: int = 0
    # sampler file of data.negatives ("": negatives.npz beside the train file)
    negatives_path: str = ""
    # planted teacher strengths (logit units)
    first_order: float = 0.4         # segment and context biases
    item_bias: float = 0.0           # per-item biases (many rare ids: slow to learn)
    fm: float = 0.8              # synthetic: strength of the pairwise (FM) signal
    dense_signal: float = 0.4    # synthetic: strength of the dense features
    clicks_signal: float = 3.0   # synthetic: strength of the clicks sequence
    views_signal: float = 1.5    # synthetic: strength of the views sequence
    # drifting online stream (gemjax.data.drift; experiments/online.py); drift_every=0: off
    drift_every: int = 0             # steps per window; the planted model moves at each window start
    drift_strength: float = 0.0      # share of fresh parameters per window: p' = sqrt(1-s^2) p + s n
    popularity_shift: int = 0        # within-category item popularity ranks rotate this far per window
    new_id_rate: float = 0.0         # share of items drawn from the window's block of never-seen ids
    drift_start: int = 0             # make_source with drift_every > 0: run step 0 is this stream step
    # parquet online training (gemjax.train.online, experiments/online.py): the column of event
    # times (integer or float seconds, or a Parquet timestamp) the time-ordered train rows are
    # sorted by; no nulls, never decreasing across the files in path order
    time_column: str = ""
    # parquet online training: width of one window of data.time_column, in seconds (86400: a
    # day); the windows are the non-empty intervals [t0 + k W, t0 + (k + 1) W), t0 the first time
    window_seconds: float = 0.0
    # Base Batch Shuffling (gemjax.data.balance): the train batch dealt to the devices as
    # length-sorted sub-batches of bbs_sub_batch samples, in snake order (synthetic: over
    # every device; parquet: over each process's devices)
    bbs: bool = False
    bbs_sub_batch: int = 8       # samples per BBS sub-batch (divides data.batch_size)

    @property
    def sequence_capacity(self) -> int:
        """Static packed capacity per sequence per batch (multiple of 128)."""
        mean_len = min(self.seq_median * math.exp(self.seq_sigma ** 2 / 2), self.seq_cap)
        need = self.capacity_slack * self.batch_size * mean_len
        return max(128, int(math.ceil(need / 128)) * 128)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    kind: str = "gem"                # "gem" (model v0), "teacher" (full GEM teacher), "lr" (baseline)
    dim: int = 16                    # embedding / token width
    use_sequences: bool = True   # read the sequence features (false: the no-sequence ablation)
    seq_layers: int = 1          # sequence encoder layers (retrieval: the tower's blocks)
    seq_heads: int = 2           # attention heads of the sequence layers
    attention: str = "block"         # "block" (BlockAttention), "softmax" or "gdpa"
    block: int = 32                  # BlockAttention block size (GEM uses 64)
    dense_tokens: int = 2        # tokens the dense features are projected to
    wukong_layers: int = 2       # Wukong interaction layers
    fmb_tokens: int = 8          # Wukong: tokens of each factorization-machine block
    lcb_tokens: int = 8          # Wukong: tokens of each linear-compression block
    fm_rank: int = 8             # Wukong: rank k of the optimized FM (Y in R^{n x k})
    # Wukong FMB MLP widths
    wukong_mlp: tuple[int, ...] = (64,)
    # head MLP widths
    head_mlp: tuple[int, ...] = (64,)
    dtype: str = "float32"           # compute dtype; parameters are float32
    # --- the full GEM teacher (kind="teacher", gemjax.models.interformer) ---
    # Its InterFormer Sequence Arch self-attention is `attention` above (one knob for
    # the sequence self-attention of either model kind; there is no separate
    # seq_attention field): "block" = 64-token-style BlockAttention (size `block`)
    # with RoPE, "softmax" = full softmax attention, "gdpa" = full GDPA (SiLU). The
    # pyramid levels always use block attention; PMA and the personalized FFN are
    # always GDPA.
    interformer_layers: int = 2
    summary_tokens: int = 4          # m: x_sum tokens
    cls_tokens: int = 4              # c, p, r: s_sum = [CLS | PMA | most recent] tokens;
    pma_tokens: int = 2              #   each may be 0 (that component removed), c + p + r > 0
    recent_tokens: int = 2       # r: most recent sequence tokens in s_sum
    # Pyramid levels per sequence, (block, pooled tokens per block, block-attention
    # layers); pooled None ("none") only on the last level. None: ((block, 4, 1),
    # (block, None, 1)) with block = model.block. Override form: levels separated
    # by "/", fields by ":", e.g. model.pyramid_levels=32:4:1/32:none:1 ("none" = default).
    pyramid_levels: tuple[tuple[int, int | None, int], ...] | None = None
    num_experts: int = 0             # > 0: the Interaction Arch is a mixture of Wukong experts
    top_k: int = 1                   # experts per sample (<= num_experts)
    capacity_factor: float | None = None   # None: no drops ("none" in overrides)
    lb_coef: float = 0.01            # weight of the experts' load-balancing loss
    cross_layer_attention: bool = True   # Wukong layer inputs attend over earlier layers' outputs
    qk_norm: bool = True         # LayerNorm on queries and keys of the sequence attention
    rope: bool = True                # RoPE on sequence self-attention ("block" always rotates)
    head_towers: str = "per_surface"     # multi-domain head: "per_surface" or "shared"
    # --- next-item retrieval (kind="retrieval": gemjax.models.retrieval, gemjax.train.retrieval) ---
    retrieval_negatives: int = 0     # 0: full softmax over the item table; N: N uniform rows per device per step
    retrieval_temperature: float = 1.0   # logits = user . item / temperature
    retrieval_l2norm: bool = False   # l2-normalise user and item vectors (cosine logits)
    retrieval_dropout: float = 0.2   # dropout on the input tokens while training
    retrieval_encoder: str = "softmax"   # "softmax": SequenceEncoder (model.attention, causal);
                                         # "hstu": HSTU blocks (gemjax.layers.hstu; GDPA SiLU, gated)
    hstu_dropout: float = 0.2        # "hstu": dropout on each block's gated attention output
    # "hstu": relative attention bias added to the logits before the SiLU: "none" (position
    # from model.rope and the recency embedding only; the GDPA kernel), "position" (a learned
    # logit per head and distance i - j), "position+time" (plus one per log-bucketed time
    # gap; needs per-event timestamps, which no schema sequence carries yet)
    hstu_rel_bias: str = "none"
    # --- distillation students (kind="student": gemjax.models.student) ---
    student_arch: str = "dlrm"       # "dlrm" (pairwise dots + MLP) or "wukong" (small Wukong + MLP)
    student_width: int = 0           # token width; 0: model.dim (else looked-up rows are projected)
    student_recent: int = 8          # newest events of each sequence's short summary
    teacher_repr_dim: int = 0        # E of the teacher features the batch carries (0: none)
    # --- FP8 GEMMs per region (gemjax.precision.policy; names separated by "+") ---
    # gem1b's step on one H200: 189.7 ms BF16, 270.6 ms FP8 (the quantize passes outweigh
    # the faster GEMMs; 203.1 ms with fp8_regions=wukong+interformer; docs/precision.md)
    precision: str = "bf16"          # "bf16": every GEMM in `dtype`; "fp8": fp8_regions' linears in FP8
    # model.precision=fp8: the regions whose linears run in FP8
    fp8_regions: str = "wukong+interformer+attn_proj+sequence"
    fp8_exclude: str = "heads+last"  # regions (or "last": the last layer) kept in `dtype`
    fp8_scaling: str = "rowwise"     # "rowwise", "tensor" or "blocked" (1x128 / 128x128 scales),
    # or "delayed": per-tensor scales from the amaxes of the last fp8_amax_history steps
    # (gemjax.precision.delayed; the histories live in the train state's "fp8_meta")
    fp8_amax_history: int = 16       # fp8_scaling=delayed: steps of amax history per operand
    fp8_margin: int = 0              # fp8_scaling=delayed: scales get 2**fp8_margin headroom
    fp8_grad_fmt: str = "e5m2"       # dy's format in dgrad / wgrad: "e5m2" or "e4m3"
    wgrad_dtype: str = "fp8"         # weight-gradient GEMM: "fp8", "bf16" or "f32"
    fp8_fast_accum: str = "none"     # "forward": the forward GEMMs in FP8 fast accumulation
    # model.precision=fp8 with FSDP-sharded kernels: which FP8 linears' kernels the train step
    # gathers as FP8 bits (quantized once per step with the GEMM's scales) instead of float32
    # (gemjax.precision.fsdp.all_gather_fp8_weight; docs/precision.md). "exact": under the
    # tensor and blocked scalings (one quantization of w serves forward and dgrad, so the step
    # is unchanged); "always": rowwise too (its dgrad re-quantizes the gathered weight per row);
    # "off": every kernel gathered in float32
    fp8_gather: str = "exact"
    # --- the teacher's transformer FFN activation (pyramid and InterFormer Sequence Arch) ---
    # "gelu" (exact, erf), "gelu_tanh" (the tanh approximation: 12% less time than exact
    # GELU for a [659072, 512] -> 1024 -> 512 FFN's forward + backward on an H200, whose
    # erf XLA expands into a long f32 polynomial), "relu" or "silu"
    ffn_activation: str = "gelu"
    # biases of the pyramid's per-token Linears (block-attention projections, FFNs, pooling
    # attention): XLA adds each bias in a pass of its own over the [tokens, width] output
    # and reduces it again for the gradient (cuBLASLt's bias epilogue is not used)
    token_bias: bool = True
    # the sequence encoders' LayerNorms (gemjax.layers.sequence): "xla" (nnx.LayerNorm),
    # "pallas" (kernels.layer_norm's Triton kernels, one pass each way; interpret mode off GPU)
    # or "auto" (pallas on a GPU, xla elsewhere). The same parameters each way
    norm_impl: str = "xla"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1_000           # train steps of the run
    seed: int = 0                # seed of the data order, the parameters and dropout
    dense_lr: float = 4e-3       # peak learning rate of the dense optimizer (optim.dense)
    sparse_lr: float = 0.5       # learning rate of the embedding tables' optimizer (optim.sparse)
    # sparse all_to_all capacity picked per step from the unique ids (EmbeddingCollection
    # exchange_buckets = routing.DEFAULT_EXCHANGE_BUCKETS), and replicas of a local table
    # copy all-gathering unique rows only (sync_buckets). On in the h200 preset (its
    # 1-GPU step: 132 ms with both, 159 ms without); off here so small CPU runs keep
    # one compiled step (the branches are fixed per batch, PlannedStep)
    sparse_exchange_buckets: bool = False
    # replicas of a local table copy all-gather unique rows only
    sparse_sync_buckets: bool = False
    # their branches fixed per batch before the step (PlannedStep) instead of a lax.switch
    # around collectives inside it, which XLA:GPU runs as a host-synced conditional
    sparse_fixed_branches: bool = True
    # duplicate sum + row-wise Adagrad of the touched rows: "xla", or "pallas" (one fused
    # kernel: 1.20 vs 1.93 ms per lookup + update step on one H200, benchmarks/bench_sparse.py;
    # inside the h200 teacher's step on one H200 128.2 vs 128.9 ms, so "xla",
    # which runs everywhere, stays the default; interpret mode, slow, off GPU)
    sparse_update_impl: str = "xla"
    # pin sparse activations and their gradients to row-major (EmbeddingCollection
    # row_major): else XLA:GPU may lay a sequence stack out feature-major and transpose
    # every per-id gradient (15 ms of the 2-GPU h200 step); false for A/B runs
    sparse_row_major: bool = True
    warmup_steps: int = 100      # linear warm-up of the dense learning rate
    log_every: int = 100         # steps between metrics rows
    # steps between evaluations (test rows; none on a schedule when selecting)
    eval_every: int = 500
    checkpoint_every: int = 500  # steps between checkpoints
    keep_checkpoints: int = 3    # newest checkpoints kept
    # restore (resume, eval, inference, export) a checkpoint step that has no
    # checksums.sha256; false: such a step is skipped for an older verified one
    trust_unverified_checkpoints: bool = False
    baselines: bool = True           # also train LR and the no-sequence model on the same stream
    # write metrics.jsonl's rows as TensorBoard scalars too, under WORKDIR/tensorboard
    # (needs tensorboardX; without it the run logs one line and writes metrics.jsonl only)
    tensorboard: bool = True
    # eval rows up to which every AUC is exact (all predictions kept on the host); an eval
    # with more rows folds them into 2^16-bin score histograms per class, (surface, task):
    # bounded memory, AUC within a stated bound (eval row keys auc_binned, auc_bin_error;
    # gemjax.train.metrics)
    exact_auc_rows: int = 2_000_000
    # K steps per call: train steps run K at a time inside one jitted call (a lax.scan over
    # K stacked batches, gemjax.train.multistep); the metrics rows are those of K = 1.
    # train.steps and the log / eval / checkpoint intervals must be multiples of it
    steps_per_call: int = 1
    # model selection on data.valid_path (gemjax.train.selection): the validation rows are
    # evaluated every valid_every steps (0: eval_every) and at the end, WORKDIR/best keeps
    # the checkpoint of the best select_metric ("ne", "auc", "loss", "hr@10", "ndcg@10",
    # "mrr", ... any key of the eval rows; ne / loss lower is better, the rest higher), the
    # run stops after `patience` validation evals without improvement (0: never), and the
    # eval rows (data.eval_path) are evaluated once, at the end, on the best state.
    # "" = no selection: the eval rows every eval_every steps
    valid_every: int = 0
    select_metric: str = ""      # validation metric that picks the best step ("": no selection)
    patience: int = 0            # validation evals without gain before stopping (0: never early)
    # --- activation checkpointing (model.kind=teacher; gemjax.layers.regions, gemjax.train.remat) ---
    # "none" (autodiff keeps what it needs), "region:policy/..." with regions pyramid, cross,
    # seq, attention, interaction, heads (or all) and policies save, recompute, offload,
    # quantize (FP8-kept inputs), e.g. "seq:recompute/attention:save/interaction:offload";
    # or "auto": the planner picks the plan for memory_budget_gb at start
    remat: str = "none"
    memory_budget_gb: float = 0.0    # device memory budget of remat=auto (GiB of the train step)
    # sorted duplicate sum of the sparse grads (routing.sum_duplicates): auto (the Pallas
    # kernel kernels.segment_sum on GPU, XLA's segment_sum elsewhere), xla or pallas
    sparse_segment_sum: str = "auto"
    # one-hot duplicate sums (routing.onehot_sums; 0 = off): an unpooled local table whose
    # unique bucket holds <= this many rows sums its per-id grads as
    # one_hot(row's unique index)^T @ grads, read in their own order (no row gather)
    sparse_onehot_rows: int = 0
    # dtype of the looked-up rows per id (sequence tokens, single ids) the model reads:
    # "table" (the table's float32) or "model" (model.dtype: a bfloat16 model then gets
    # bfloat16 gradients per id, half the bytes through the duplicate sum and its concat)
    sparse_act_dtype: str = "table"


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The optimizers (gemjax.train.optim builds them; learning rates and warm-up are
    train.dense_lr, train.sparse_lr and train.warmup_steps)."""

    # dense params: any optax optimizer taking a learning_rate (adam, adamw, adagrad, sgd,
    # lamb, lion, ...), after clipping the global gradient norm to clip_norm (0: no clip)
    dense: str = "adam"
    # "warmup_cosine" (to dense_lr * final_lr_scale at train.steps), "warmup_constant"
    # or "constant"
    schedule: str = "warmup_cosine"
    final_lr_scale: float = 0.05  # warmup_cosine ends at dense_lr times this
    clip_norm: float = 10.0      # global gradient-norm clip of the dense params (0: none)
    weight_decay: float = 0.0        # for optimizers that take one (adamw, lamb, lion)
    # embedding tables: "rowwise_adagrad", "adagrad", "sgd" or "lazy_adam"
    sparse: str = "rowwise_adagrad"


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout of a run (gemjax.train.layout builds it; a run's config.json
    records the layout it ran with). Strings in experiments/train.py's flag syntax."""

    # physical mesh axes outer to inner, gemjax.parallel.mesh's spec, e.g.
    # "replica=2,fsdp=-1,expert=2"; "": every device on one "batch" axis
    mesh: str = ""
    # overrides of the logical-axis rules (gemjax.parallel.rules.DEFAULT_RULES),
    # e.g. "mlp=fsdp,embed=" (name= replicates); "": the defaults
    logical_rules: str = ""
    # '+'-separated mesh axes the embedding tables are replicated over (2d / fs2d plans)
    table_replica_axes: str = ""
    # embedding table plan: "" (the planner picks per table), one plan kind for every
    # table ("row_wise", "2d_range", ...; gemjax.sparse.plans.resolve), or per table
    # "table:kind[@capacity_factor]/..." (capacity_factor a number or none)
    table_plan: str = ""


@dataclasses.dataclass(frozen=True)
class Config:
    name: str = "small"
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    optim: OptimConfig = OptimConfig()
    # the features the models are built for (schema_of); None: the default source's, the
    # synthetic stream's schema of `data`
    features: FeatureSchema | None = None


# The synthetic stream's features (gemjax.data.synthetic draws them): its schema is a pure
# function of DataConfig, so a config resolves it without reading a data source.
SEQUENCES = ("clicks", "views")
SEQUENCE_FIELDS = ("item", "cat", "event")
SPARSE_FEATURES = ("user", "segment", "context", "item", "item_cat")
SYNTHETIC_FIELD_TABLES = {"item": "item", "cat": "category", "event": "event"}   # sequence field -> table
SYNTHETIC_SPARSE_TABLES = {"user": "user", "segment": "segment", "context": "context", "item": "item",
                           "item_cat": "category"}                                # sparse feature -> table


@functools.lru_cache(maxsize=64)
def synthetic_schema(d: DataConfig) -> FeatureSchema:
    """The synthetic stream's FeatureSchema: tables user, segment, context, item, category,
    event (vocabularies from d, width model.dim, strict bounds); sparse features
    SPARSE_FEATURES (item_cat reads table category); d.num_dense dense features;
    sequences SEQUENCES, each of SEQUENCE_FIELDS (item, cat -> category, event), capped
    at d.seq_cap; d.num_surfaces x d.num_tasks logits."""
    vocab = {"user": d.vocab_user, "segment": d.vocab_segment, "context": d.vocab_context,
             "item": d.vocab_item, "category": d.num_categories, "event": d.num_event_types}
    fields = tuple(EventField(f, SYNTHETIC_FIELD_TABLES[f]) for f in SEQUENCE_FIELDS)
    return FeatureSchema(
        tables=tuple(Table(name, v) for name, v in vocab.items()),
        sparse=tuple(SparseFeature(f, SYNTHETIC_SPARSE_TABLES[f]) for f in SPARSE_FEATURES),
        dense=tuple(f"dense{i}" for i in range(d.num_dense)),
        sequences=tuple(SequenceFeature(s, fields, d.seq_cap) for s in SEQUENCES),
        surfaces=tuple(f"surface{i}" for i in range(d.num_surfaces)),
        tasks=tuple(f"task{k}" for k in range(d.num_tasks)),
        surface_column="surface")


def schema_of(cfg) -> FeatureSchema:
    """The schema a config trains on: cfg.features, or (None, or a config without the
    field) the default source's, the synthetic stream's of cfg.data (synthetic_schema).
    How the models, the trainer and the cost models read it; no data source is read."""
    features = getattr(cfg, "features", None)
    if features is not None:
        return features
    return synthetic_schema(cfg.data)


def with_schema(cfg):
    """cfg with its schema made explicit (features = schema_of(cfg)): what a run's
    config.json records (config_from_dict reads the default source's schema back as
    features=None)."""
    return dataclasses.replace(cfg, features=schema_of(cfg))


# The presets by name; gemjax.presets fills it on import (gemjax/__init__.py imports it).
PRESETS: dict[str, Config] = {}


# The sections of a Config that hold fields ("section.field=value" overrides).
SECTIONS = ("data", "model", "train", "parallel", "optim")


def _is_none(value: str) -> bool:
    return value.strip().lower() in ("none", "")


def _coerce(value: str, typ: Any, path: str):
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):        # X | None
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if _is_none(value):
            return None
        if len(args) != 1:
            raise ValueError(f"override {path}: unsupported field type {typ}")
        return _coerce(value, args[0], path)
    if origin is tuple and typing.get_origin(typing.get_args(typ)[0]) is tuple:
        # nested tuples: "32:4:1/32:none:1" -> ((32, 4, 1), (32, None, 1))
        inner = typing.get_args(typ)[0]
        kinds = typing.get_args(inner)
        levels = []
        for part in value.split("/"):
            fields = part.replace("(", "").replace(")", "").split(":")
            if len(fields) != len(kinds):
                raise ValueError(f"override {path}={value!r}: each '/'-separated entry needs "
                                 f"{len(kinds)} ':'-separated fields, got {part!r}")
            levels.append(tuple(_coerce(v, k, path) for v, k in zip(fields, kinds)))
        return tuple(levels)
    try:
        if typ is bool:
            if value.lower() in ("1", "true", "yes"):
                return True
            if value.lower() in ("0", "false", "no"):
                return False
            raise ValueError(value)
        if typ is int:
            return int(float(value)) if "e" in value.lower() else int(value)
        if typ is float:
            return float(value)
        if typ is str:
            return value
        if origin is tuple:
            return tuple(int(v) for v in value.replace("(", "").replace(")", "").split(":") if v)
    except ValueError:
        raise ValueError(f"override {path}={value!r}: not a valid {getattr(typ, '__name__', typ)}") from None
    raise ValueError(f"override {path}: unsupported field type {typ}")


def parse_overrides(text: str) -> dict[str, str]:
    """"section.field=value,..." -> {"section.field": "value"} (later repeats win)."""
    items = {}
    for part in text.split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise ValueError(f"override {part!r} must look like section.field=value")
        k, v = part.split("=", 1)
        items[k.strip()] = v.strip()
    return items


def apply_overrides(cfg: Config, overrides: str | dict[str, str] | None) -> Config:
    """Apply "section.field=value,..." overrides (tuples as 64:64, tuples of tuples as
    32:4:1/32:none:1, optional fields as none). A path reaches any depth (replace_path):
    "features.sequences.history.max_len=100" sets a field of an explicit schema's
    sequence. Unknown fields are errors."""
    if not overrides:
        return cfg
    if isinstance(overrides, str):
        overrides = parse_overrides(overrides)
    for path, value in overrides.items():
        section, _, field = path.partition(".")
        if section not in (*SECTIONS, "features") or not field:
            raise ValueError(f"override {path!r}: expected <section>.<field> with a section of "
                             f"{', '.join(SECTIONS)} (or features.<...> of an explicit schema)")
        if section == "features" and cfg.features is None:
            raise ValueError(f"override {path!r}: config {cfg.name!r} has no explicit features "
                             f"(its schema is the synthetic stream's, set by the data.* fields)")
        cfg = replace_path(cfg, path, str(value))
    validate(cfg)
    return cfg


def replace_path(obj: Any, path: str, value: str) -> Any:
    """`obj` (a frozen dataclass) with the field at dotted `path` set to `value`, a string
    coerced to the field's type as in apply_overrides; every dataclass on the way is
    rebuilt (its __post_init__ checks run). A path goes through fields of nested
    dataclasses and entries of tuples, an entry named by its `name` field or by its
    index: "tables.item.vocab", "sequences.0.max_len". ValueError naming the path."""
    names = path.split(".")
    if not all(names):
        raise ValueError(f"override {path!r}: an empty name between dots")
    return _replace(obj, type(obj), names, 0, value, path)


def _replace(obj: Any, typ: Any, names: list[str], depth: int, value: str, path: str) -> Any:
    """obj (of field type typ) with names[depth:] below it set to value."""
    name, here = names[depth], ".".join(names[:depth]) or type(obj).__name__
    if typing.get_origin(typ) in (typing.Union, types.UnionType):      # X | None
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    if dataclasses.is_dataclass(obj):
        hints = typing.get_type_hints(type(obj))
        if name not in hints:
            known = ", ".join(f.name for f in dataclasses.fields(obj))
            raise ValueError(f"override {path!r}: {here} has no field {name!r}; known: {known}")
        sub_typ = hints[name]
        old = getattr(obj, name)
    elif isinstance(obj, tuple):
        index = _entry_index(obj, name)
        if index is None:
            raise ValueError(f"override {path!r}: {here} has no entry {name!r} (entries: names "
                             f"or indices 0..{len(obj) - 1})")
        args = typing.get_args(typ)
        sub_typ = args[0] if len(args) == 2 and args[1] is Ellipsis else args[index]
        old = obj[index]
    else:
        raise ValueError(f"override {path!r}: {here} is {obj!r}, which has no fields")
    if depth + 1 == len(names):
        new = _coerce(value, sub_typ, path)
    else:
        new = _replace(old, sub_typ, names, depth + 1, value, path)
    if isinstance(obj, tuple):
        return obj[:index] + (new,) + obj[index + 1:]
    try:
        return dataclasses.replace(obj, **{name: new})
    except ValueError as e:
        raise ValueError(f"override {path}={value!r}: {e}") from None


def _entry_index(entries: tuple, name: str) -> int | None:
    """The index of the entry whose `name` field is `name`, else `name` read as an index."""
    for i, entry in enumerate(entries):
        if getattr(entry, "name", None) == name:
            return i
    return int(name) if name.isdigit() and int(name) < len(entries) else None


def validate(cfg: Config) -> None:
    """ValueError naming the first field out of its range (called by get_config,
    apply_overrides and train)."""
    d, m = cfg.data, cfg.model
    checks = [
        *_source_checks(d, cfg.features),
        *_negatives_checks(d),
        (d.batch_size >= 1, f"data.batch_size must be >= 1, got {d.batch_size}"),
        (d.num_surfaces >= 1 and d.num_tasks >= 1, "data.num_surfaces and data.num_tasks must be >= 1"),
        (10 <= d.vocab_user <= 10**9, f"data.vocab_user must be in [10, 1e9], got {d.vocab_user}"),
        (d.vocab_item >= d.num_categories, "data.vocab_item must be >= data.num_categories"),
        (min(d.vocab_segment, d.vocab_context) >= 2, "data.vocab_segment and data.vocab_context must be >= 2"),
        (1 <= d.seq_cap <= 16_384, f"data.seq_cap must be in [1, 16384], got {d.seq_cap}"),
        (d.seq_median > 0 and d.seq_sigma >= 0, "data.seq_median must be > 0 and data.seq_sigma >= 0"),
        (d.recent >= 1, "data.recent must be >= 1"),
        (d.drift_every >= 0, f"data.drift_every must be >= 0, got {d.drift_every}"),
        (d.drift_start >= 0, f"data.drift_start must be >= 0, got {d.drift_start}"),
        (0.0 <= d.drift_strength <= 1.0, f"data.drift_strength must be in [0, 1], got {d.drift_strength}"),
        (d.popularity_shift >= 0, f"data.popularity_shift must be >= 0, got {d.popularity_shift}"),
        (0.0 <= d.new_id_rate <= 1.0, f"data.new_id_rate must be in [0, 1], got {d.new_id_rate}"),
        (m.kind in ("gem", "teacher", "lr", "retrieval", "student"),
         f"model.kind must be gem, teacher, lr, retrieval or student, got {m.kind!r}"),
        *_student_checks(m),
        *_retrieval_checks(m, cfg.train),
        (m.attention in ("block", "softmax", "gdpa"), f"model.attention must be block, softmax or gdpa, got {m.attention!r}"),
        (m.dtype in ("float32", "bfloat16"), f"model.dtype must be float32 or bfloat16, got {m.dtype!r}"),
        (m.fp8_gather in ("exact", "always", "off"),
         f"model.fp8_gather must be exact, always or off, got {m.fp8_gather!r}"),
        (m.block >= 1, f"model.block must be >= 1, got {m.block}"),
        (m.dim >= 1 and m.dim % max(m.seq_heads, 1) == 0, f"model.dim ({m.dim}) must be divisible by model.seq_heads ({m.seq_heads})"),
        (d.eval_batches >= (0 if d.source == "parquet" else 1),
         f"data.eval_batches must be >= 1 (0, the whole eval data, with data.source=parquet), "
         f"got {d.eval_batches}"),
        (d.host_workers >= 0, f"data.host_workers must be >= 0, got {d.host_workers}"),
        (d.capacity_slack > 0, f"data.capacity_slack must be > 0, got {d.capacity_slack}"),
        (d.bbs_sub_batch >= 1 and (not d.bbs or d.batch_size % d.bbs_sub_batch == 0),
         f"data.bbs_sub_batch ({d.bbs_sub_batch}) must be >= 1 and divide data.batch_size "
         f"({d.batch_size}) when data.bbs is on"),
        (cfg.train.steps >= 0, "train.steps must be >= 0"),
        (cfg.train.sparse_update_impl in ("xla", "pallas"),
         f"train.sparse_update_impl must be xla or pallas, got {cfg.train.sparse_update_impl!r}"),
        (cfg.train.sparse_act_dtype in ("table", "model"),
         f"train.sparse_act_dtype must be table or model, got {cfg.train.sparse_act_dtype!r}"),
        (cfg.train.sparse_segment_sum in ("auto", "xla", "pallas"),
         f"train.sparse_segment_sum must be auto, xla or pallas, got {cfg.train.sparse_segment_sum!r}"),
        (cfg.train.sparse_onehot_rows >= 0,
         f"train.sparse_onehot_rows must be >= 0 (0 = off), got {cfg.train.sparse_onehot_rows}"),
        *_train_checks(cfg.train),
        *_optim_checks(cfg.optim),
        *_selection_checks(cfg),
        *_steps_per_call_checks(cfg),
        *_teacher_checks(m),
        *_feature_checks(cfg),
        *_remat_checks(cfg),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(f"config {cfg.name!r}: {msg}")


MAX_LR = 100.0     # larger learning rates are typos (1e30), not settings


def _train_checks(t: TrainConfig) -> list[tuple[bool, str]]:
    """Intervals >= 1 (0 would divide by zero after compile); learning rates finite in
    [0, MAX_LR] (NaN fails every comparison)."""
    out = [(getattr(t, f) >= 1, f"train.{f} must be >= 1, got {getattr(t, f)}")
           for f in ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints")]
    out.append((t.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {t.warmup_steps}"))
    out += [(0.0 <= getattr(t, f) <= MAX_LR,
             f"train.{f} must be a finite number in [0, {MAX_LR:g}], got {getattr(t, f)}")
            for f in ("dense_lr", "sparse_lr")]
    return out


def _optim_checks(o: OptimConfig) -> list[tuple[bool, str]]:
    """Names the optimizers know; clip and decay finite and >= 0 (the dense name is
    checked against optax by gemjax.train.optim when the Trainer is built)."""
    return [
        (o.schedule in ("warmup_cosine", "warmup_constant", "constant"),
         f"optim.schedule must be warmup_cosine, warmup_constant or constant, got {o.schedule!r}"),
        (o.sparse in ("rowwise_adagrad", "adagrad", "sgd", "lazy_adam"),
         f"optim.sparse must be rowwise_adagrad, adagrad, sgd or lazy_adam, got {o.sparse!r}"),
        (bool(o.dense) and o.dense.isidentifier(),
         f"optim.dense must name an optax optimizer (adam, adamw, ...), got {o.dense!r}"),
        (0.0 <= o.clip_norm < math.inf, f"optim.clip_norm must be finite and >= 0, got {o.clip_norm}"),
        (0.0 <= o.weight_decay < math.inf,
         f"optim.weight_decay must be finite and >= 0, got {o.weight_decay}"),
        (0.0 <= o.final_lr_scale <= 1.0,
         f"optim.final_lr_scale must be in [0, 1], got {o.final_lr_scale}"),
    ]


# metrics of model selection, by model kind: the eval rows' keys (gemjax.train.metrics.flat,
# gemjax.train.retrieval) and whether lower ("min") or higher ("max") is better
_BCE_SELECT = re.compile(r"(?:surface\d+/)?(?:task\d+/)?(ne|auc|log_loss)|loss")
_RETRIEVAL_SELECT = re.compile(r"(?:hr|ndcg)@(?:10|50|200)(?:_unmasked)?|mrr(?:_unmasked)?")


def select_mode(metric: str, model_kind: str) -> str | None:
    """"min" (ne, log_loss, loss: lower is better) or "max" (auc, hr@k, ndcg@k, mrr) for a
    selection metric of a model.kind; None if its eval rows have no such metric."""
    if model_kind == "retrieval":
        return "max" if _RETRIEVAL_SELECT.fullmatch(metric) else None
    m = _BCE_SELECT.fullmatch(metric)
    if not m:
        return None
    return "max" if m.group(1) == "auc" else "min"


def _selection_checks(cfg: Config) -> list[tuple[bool, str]]:
    """train.select_metric known for the model kind and given validation rows; for the
    synthetic source data.valid_path selects the held-out stream and names no files."""
    t, d = cfg.train, cfg.data
    out = [(t.valid_every >= 0, f"train.valid_every must be >= 0 (0: train.eval_every), got "
                                f"{t.valid_every}"),
           (t.patience >= 0, f"train.patience must be >= 0 (0: no early stop), got {t.patience}"),
           (d.source != "synthetic" or "/" not in d.valid_path,
            f"data.valid_path={d.valid_path!r} names files, but data.source=synthetic reads none: "
            f"data.valid_path=synthetic selects the held-out synthetic stream"),
           (d.source != "parquet" or d.valid_path != "synthetic",
            "data.valid_path=synthetic is the synthetic stream's held-out part; data.source=parquet "
            "needs the validation rows' file, directory or glob"),
           (d.source != "parquet" or bool(d.eval_path) or bool(t.select_metric),
            "data.source=parquet needs data.eval_path (a file, a directory or a glob of the eval "
            "rows; only a run with train.select_metric may leave it empty: no test eval)")]
    if not t.select_metric:
        return out + [(t.patience == 0, "train.patience needs train.select_metric (the metric "
                                        "early stopping watches)")]
    kinds = ("hr@10, ndcg@10, hr@50, ndcg@50, hr@200, ndcg@200 (or _unmasked), mrr" if cfg.model.kind == "retrieval"
             else "ne, auc, log_loss, loss, or one of them per task / surface: task0/auc, "
                  "surface1/task0/ne")
    return out + [
        (select_mode(t.select_metric, cfg.model.kind) is not None,
         f"train.select_metric={t.select_metric!r} is no eval metric of model.kind="
         f"{cfg.model.kind}: choose {kinds}"),
        (bool(d.valid_path), f"train.select_metric={t.select_metric} needs data.valid_path (the "
                             f"validation rows; data.valid_path=synthetic for the synthetic "
                             f"stream), or train.select_metric= to train without selection")]


def _steps_per_call_checks(cfg: Config) -> list[tuple[bool, str]]:
    """K >= 1; train.steps and the log / eval / checkpoint intervals multiples of K (every
    boundary falls between two calls); retrieval trains one step per call."""
    k = cfg.train.steps_per_call
    if k < 1:
        return [(False, f"train.steps_per_call must be >= 1, got {k}")]
    out = [(getattr(cfg.train, f) % k == 0,
            f"train.{f} ({getattr(cfg.train, f)}) must be a multiple of train.steps_per_call "
            f"({k}): the loop logs, evaluates, checkpoints and stops between calls of {k} steps")
           for f in ("steps", "log_every", "eval_every", "checkpoint_every", "valid_every")]
    out.append((k == 1 or cfg.model.kind != "retrieval",
                f"model.kind=retrieval runs with train.steps_per_call=1, got {k}"))
    return out


def _remat_checks(cfg: Config) -> list[tuple[bool, str]]:
    """The plan's syntax is checked where the teacher is built (gemjax.layers.regions)."""
    t = cfg.train
    return [(t.memory_budget_gb >= 0, f"train.memory_budget_gb must be >= 0, got {t.memory_budget_gb}"),
            (t.remat != "auto" or t.memory_budget_gb > 0,
             "train.remat=auto needs train.memory_budget_gb > 0 (the device memory budget, GiB)"),
            (t.remat in ("", "none") or cfg.model.kind == "teacher",
             f"train.remat={t.remat} applies to model.kind=teacher only, got {cfg.model.kind!r}")]


SOURCES = ("synthetic", "parquet")


def _source_checks(d: DataConfig, features: FeatureSchema | None) -> list[tuple[bool, str]]:
    out = [(d.source in SOURCES, f"data.source must be one of {', '.join(SOURCES)}, got {d.source!r}"),
           (d.order in ("shuffle", "time"), f"data.order must be shuffle or time, got {d.order!r}"),
           (d.shuffle_window >= 1, f"data.shuffle_window must be >= 1, got {d.shuffle_window}"),
           (d.nan in ("error", "zero"), f"data.nan must be error or zero, got {d.nan!r}")]
    if d.source == "parquet":
        out += [(features is not None,
                 "data.source=parquet needs the feature schema of the files: config.features "
                 "(experiments/train.py --features=schema.json)"),
                (bool(d.train_path), "data.source=parquet needs data.train_path (a file, a "
                                     "directory or a glob of the training rows)"),
                (bool(d.eval_path or d.valid_path),
                 "data.source=parquet needs data.eval_path (a file, a directory or a glob of the "
                 "eval rows)")]
    return out


def _negatives_checks(d: DataConfig) -> list[tuple[bool, str]]:
    """Resampled train negatives (gemjax.data.negatives): a parquet source, whole groups."""
    return [(d.negatives >= 0, f"data.negatives must be >= 0, got {d.negatives}"),
            (d.batch_size % (1 + max(d.negatives, 0)) == 0,
             f"data.batch_size ({d.batch_size}) must be a multiple of 1 + data.negatives "
             f"({1 + d.negatives}): each positive brings its negatives"),
            (not d.negatives or d.source == "parquet",
             "data.negatives (resampled negatives) needs data.source=parquet")]


def _feature_checks(cfg: Config) -> list[tuple[bool, str]]:
    f, d = cfg.features, cfg.data
    if f is None or d.source != "synthetic":
        return []
    return [(f.num_surfaces == d.num_surfaces and f.num_tasks == d.num_tasks,
             f"features has {f.num_surfaces} surfaces x {f.num_tasks} tasks, data.num_surfaces x "
             f"data.num_tasks is {d.num_surfaces} x {d.num_tasks} (the evaluator counts those)")]


def _student_checks(m: ModelConfig) -> list[tuple[bool, str]]:
    return [(m.student_arch in ("dlrm", "wukong"),
             f"model.student_arch must be dlrm or wukong, got {m.student_arch!r}"),
            (m.student_width >= 0, f"model.student_width must be >= 0, got {m.student_width}"),
            (m.student_recent >= 1, f"model.student_recent must be >= 1, got {m.student_recent}"),
            (m.teacher_repr_dim >= 0,
             f"model.teacher_repr_dim must be >= 0, got {m.teacher_repr_dim}")]


def _retrieval_checks(m: ModelConfig, t: TrainConfig) -> list[tuple[bool, str]]:
    on = m.kind == "retrieval"
    return [(m.retrieval_negatives >= 0,
             f"model.retrieval_negatives must be >= 0, got {m.retrieval_negatives}"),
            (m.retrieval_temperature > 0,
             f"model.retrieval_temperature must be > 0, got {m.retrieval_temperature}"),
            (0.0 <= m.retrieval_dropout < 1.0,
             f"model.retrieval_dropout must be in [0, 1), got {m.retrieval_dropout}"),
            (m.retrieval_encoder in ("softmax", "hstu"),
             f"model.retrieval_encoder must be softmax or hstu, got {m.retrieval_encoder!r}"),
            (0.0 <= m.hstu_dropout < 1.0,
             f"model.hstu_dropout must be in [0, 1), got {m.hstu_dropout}"),
            (m.hstu_rel_bias in ("none", "position", "position+time"),
             f"model.hstu_rel_bias must be none, position or position+time, got "
             f"{m.hstu_rel_bias!r}"),
            (not on or m.retrieval_encoder == "hstu" or m.hstu_rel_bias == "none",
             f"model.hstu_rel_bias={m.hstu_rel_bias} needs model.retrieval_encoder=hstu, got "
             f"{m.retrieval_encoder!r}"),
            (not on or m.retrieval_encoder == "hstu" or m.attention in ("softmax", "gdpa"),
             f"model.kind=retrieval needs causal attention: model.attention softmax or gdpa, "
             f"got {m.attention!r}"),
            (not on or m.use_sequences,
             "model.kind=retrieval reads the event sequence: model.use_sequences must be true"),
            # the scored item rows are ids of no batch, so no per-batch sparse branch plan
            (not on or not (t.sparse_exchange_buckets or t.sparse_sync_buckets),
             "model.kind=retrieval runs with train.sparse_exchange_buckets and "
             "train.sparse_sync_buckets off")]


FFN_ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
NORM_IMPLS = ("xla", "pallas", "auto")


def _teacher_checks(m: ModelConfig) -> list[tuple[bool, str]]:
    levels = m.pyramid_levels or ()
    return [
        (m.interformer_layers >= 1, f"model.interformer_layers must be >= 1, got {m.interformer_layers}"),
        (m.summary_tokens >= 1, f"model.summary_tokens must be >= 1, got {m.summary_tokens}"),
        (min(m.cls_tokens, m.pma_tokens, m.recent_tokens) >= 0
         and m.cls_tokens + m.pma_tokens + m.recent_tokens > 0,
         f"model.cls_tokens ({m.cls_tokens}), model.pma_tokens ({m.pma_tokens}) and "
         f"model.recent_tokens ({m.recent_tokens}) must be >= 0 with a positive sum"),
        (m.num_experts >= 0, f"model.num_experts must be >= 0, got {m.num_experts}"),
        (m.num_experts == 0 or 1 <= m.top_k <= m.num_experts,
         f"model.top_k ({m.top_k}) must be in [1, model.num_experts={m.num_experts}]"),
        (m.capacity_factor is None or m.capacity_factor > 0,
         f"model.capacity_factor must be > 0 or none, got {m.capacity_factor}"),
        (m.lb_coef >= 0, f"model.lb_coef must be >= 0, got {m.lb_coef}"),
        (m.ffn_activation in FFN_ACTIVATIONS,
         f"model.ffn_activation must be one of {FFN_ACTIVATIONS}, got {m.ffn_activation!r}"),
        (m.norm_impl in NORM_IMPLS,
         f"model.norm_impl must be one of {NORM_IMPLS}, got {m.norm_impl!r}"),
        (m.head_towers in ("per_surface", "shared"),
         f"model.head_towers must be per_surface or shared, got {m.head_towers!r}"),
        (m.pyramid_levels is None or (
            len(levels) >= 1 and all(len(lv) == 3 for lv in levels)
            and all(b >= 1 and n >= 0 and (p is None or p >= 1) for b, p, n in levels)
            and all(p is not None for _, p, _ in levels[:-1])),
         f"model.pyramid_levels must be none or (block>=1, pooled>=1 or None, layers>=0) "
         f"levels with pooled None only on the last, got {m.pyramid_levels}"),
    ]


def get_config(name: str, overrides: str | dict[str, str] | None = None) -> Config:
    """Preset `name` (PRESETS) validated, then `overrides` (apply_overrides)."""
    if name not in PRESETS:
        raise ValueError(f"unknown config preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[name]
    validate(cfg)
    return apply_overrides(cfg, overrides)



def on_converted_files(name: str, data_dir: str, overrides: str | dict[str, str] | None = None) -> Config:
    """Preset `name` on the files a converter (experiments/convert_*.py) wrote to data_dir:
    its schema.json as Config.features, train.parquet and test.parquet as the train and
    eval streams; then `overrides`. FileNotFoundError / ValueError name the schema file."""
    import json
    import os
    path = os.path.join(data_dir, "schema.json")
    with open(path) as f:
        try:
            schema = FeatureSchema.from_dict(json.load(f))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a feature schema ({e})") from e
    cfg = apply_overrides(dataclasses.replace(get_config(name), features=schema),
                          {"data.train_path": os.path.join(data_dir, "train.parquet"),
                           "data.eval_path": os.path.join(data_dir, "test.parquet")})
    return apply_overrides(cfg, overrides)

def _from_json(value: Any, typ: Any, path: str):
    """A JSON value (lists for tuples) as field type `typ`; ValueError naming `path`."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):        # X | None
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(typ) if a is not type(None)]
        return _from_json(value, inner, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config field {path}: expected a list, got {value!r}")
        args = typing.get_args(typ)
        kinds = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(kinds) != len(value):
            raise ValueError(f"config field {path}: expected {len(kinds)} entries, got {value!r}")
        return tuple(_from_json(v, k, f"{path}[{i}]") for i, (v, k) in enumerate(zip(value, kinds)))
    ok = {bool: lambda v: isinstance(v, bool), str: lambda v: isinstance(v, str),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
    if typ in ok:
        if not ok[typ](value):
            raise ValueError(f"config field {path}: expected {typ.__name__}, got {value!r}")
        return float(value) if typ is float else value
    raise ValueError(f"config field {path}: unsupported field type {typ}")


def config_from_dict(d: dict) -> Config:
    """The Config that `dataclasses.asdict(cfg)` (a run's WORKDIR/config.json) came from.

    Fields missing from `d` take their defaults; an unknown section or field, or a
    value of the wrong type, is a ValueError naming it. The result is validated.
    A "features" schema equal to the synthetic stream's for `data` (what train() records
    for a synthetic config without one) comes back as features=None, so it keeps
    following `data`.
    """
    unknown = set(d) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise ValueError(f"config: unknown sections {sorted(unknown)}; known: name, "
                         f"{', '.join(SECTIONS)}, features")
    kw: dict[str, Any] = {}
    if "name" in d:
        kw["name"] = _from_json(d["name"], str, "name")
    if d.get("features") is not None:
        kw["features"] = FeatureSchema.from_dict(d["features"])
    for section in SECTIONS:
        if section not in d:
            continue
        cls = type(getattr(Config(), section))
        hints = typing.get_type_hints(cls)
        fields = {f.name for f in dataclasses.fields(cls)}
        bad = set(d[section]) - fields
        if bad:
            raise ValueError(f"config: {section} has no fields {sorted(bad)}; "
                             f"known: {', '.join(sorted(fields))}")
        kw[section] = cls(**{k: _from_json(v, hints[k], f"{section}.{k}") for k, v in d[section].items()})
    cfg = Config(**kw)
    if (cfg.features is not None and cfg.data.source == "synthetic"
            and cfg.features == schema_of(dataclasses.replace(cfg, features=None))):
        cfg = dataclasses.replace(cfg, features=None)
    validate(cfg)
    return cfg


def field_help() -> dict[str, str]:
    """{"section.field": help} for every field of the config sections: the comment on
    the field's line and the comment lines right above it in this module's source (the
    text a reader of the dataclass sees), "" for a field with neither."""
    import ast
    import inspect
    import io
    import tokenize
    source = inspect.getsource(inspect.getmodule(field_help))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    classes = {type(getattr(Config(), s)).__name__: s for s in SECTIONS}
    out = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.ClassDef) and node.name in classes):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            above, n = [], item.lineno - 1
            while n in comments and lines[n - 1].lstrip().startswith("#"):
                above.insert(0, comments[n].strip("- "))
                n -= 1
            parts = [p for p in (*above, comments.get(item.lineno, "")) if p]
            out[f"{classes[node.name]}.{item.target.id}"] = " ".join(parts)
    return out


def describe_fields(cfg: Config) -> str:
    """Every field of cfg's sections, one per line: `section.field = value  (type) help`,
    for --helpconfig."""
    helps = field_help()
    rows = []
    for section in SECTIONS:
        sub = getattr(cfg, section)
        hints = typing.get_type_hints(type(sub))
        for f in dataclasses.fields(sub):
            typ = getattr(hints[f.name], "__name__", str(hints[f.name]))
            rows.append(f"{section}.{f.name} = {getattr(sub, f.name)!r}  ({typ})  "
                        f"{helps.get(f'{section}.{f.name}', '')}".rstrip())
    return "\n".join(rows)
