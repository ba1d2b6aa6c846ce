"""Configs: the dataclasses of a run, overridable field by field at any depth.

    cfg = get_config("small", overrides="data.batch_size=512,model.dim=32")
    cfg = config_from_dict(json.load(open("runs/x/config.json")))   # a run's config back

The tree: Config.{data, model, train, parallel, optim, sparse}, with sub-records
data.synthetic (the synthetic stream's shape), data.drift (the drifting stream),
model.teacher / model.retrieval / model.student (each model kind's own fields),
model.precision (FP8 GEMMs), optim.dense / optim.sparse (each optimizer with its
learning rate). An override path names a leaf ("model.teacher.num_experts=4");
ALIASES maps each path of the flat tree the sub-records replaced ("model.num_experts",
"train.dense_lr", ...) to its path now, for overrides and old config.json files alike.

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
class SyntheticConfig:
    """The synthetic stream's shape and planted strengths (gemjax.data.synthetic; its
    feature schema is synthetic_schema of these fields)."""

    num_surfaces: int = 2        # surfaces (e.g. feed, video), each with its own head
    num_tasks: int = 2           # tasks (labels) per sample, e.g. click and conversion
    vocab_user: int = 100_000        # user ids: Zipf, no direct signal (too many to learn)
    vocab_segment: int = 200         # user segment: first-order + FM signal
    vocab_context: int = 50          # context: first-order + FM signal
    vocab_item: int = 4_000          # items (candidate and events); category = item % num_categories
    num_categories: int = 8      # item categories
    num_event_types: int = 4     # event types of the sequences
    num_dense: int = 4           # dense features
    zipf: float = 1.05           # Zipf exponent of id popularity
    seq_median: float = 32.0         # log-normal sequence lengths
    seq_sigma: float = 0.8       # log-sigma of the sequence lengths
    seq_cap: int = 256               # longer sequences keep their most recent events (counted)
    # planted teacher strengths (logit units)
    first_order: float = 0.4         # segment and context biases
    item_bias: float = 0.0           # per-item biases (many rare ids: slow to learn)
    fm: float = 0.8              # strength of the pairwise (FM) signal
    dense_signal: float = 0.4    # strength of the dense features
    clicks_signal: float = 3.0   # strength of the clicks sequence
    views_signal: float = 1.5    # strength of the views sequence


@dataclasses.dataclass(frozen=True)
class DriftConfig:
    """The drifting online stream (gemjax.data.drift; experiments/online.py); every=0: off."""

    every: int = 0             # steps per window; the planted model moves at each window start
    strength: float = 0.0      # share of fresh parameters per window: p' = sqrt(1-s^2) p + s n
    popularity_shift: int = 0        # within-category item popularity ranks rotate this far per window
    new_id_rate: float = 0.0         # share of items drawn from the window's block of never-seen ids
    start: int = 0             # make_source with drift.every > 0: run step 0 is this stream step


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The data source (gemjax.data.source.make_source) and its settings.

    source "synthetic": the planted-teacher stream (gemjax.data.synthetic), shaped by
    data.synthetic. source "parquet": the user's files
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
    # recency window over sequences (the gem model's recent pooling, the synthetic teacher's)
    recent: int = 32
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
    # the synthetic stream's shape and planted strengths
    synthetic: SyntheticConfig = SyntheticConfig()
    # the drifting online stream (drift.every=0: off)
    drift: DriftConfig = DriftConfig()

    @property
    def sequence_capacity(self) -> int:
        """Static packed capacity per sequence per batch (multiple of 128)."""
        s = self.synthetic
        mean_len = min(s.seq_median * math.exp(s.seq_sigma ** 2 / 2), s.seq_cap)
        need = self.capacity_slack * self.batch_size * mean_len
        return max(128, int(math.ceil(need / 128)) * 128)


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    """The full GEM teacher's own fields (model.kind="teacher", gemjax.models.interformer).

    Its InterFormer Sequence Arch self-attention is model.attention (one knob for the
    sequence self-attention of either model kind): "block" = 64-token-style BlockAttention
    (size model.block) with RoPE, "softmax" = full softmax attention, "gdpa" = full GDPA
    (SiLU). The pyramid levels always use block attention; PMA and the personalized FFN
    are always GDPA.
    """

    interformer_layers: int = 2      # InterFormer layers
    summary_tokens: int = 4          # m: x_sum tokens
    cls_tokens: int = 4              # c, p, r: s_sum = [CLS | PMA | most recent] tokens;
    pma_tokens: int = 2              #   each may be 0 (that component removed), c + p + r > 0
    recent_tokens: int = 2       # r: most recent sequence tokens in s_sum
    # Pyramid levels per sequence, (block, pooled tokens per block, block-attention
    # layers); pooled None ("none") only on the last level. None: ((block, 4, 1),
    # (block, None, 1)) with block = model.block. Override form: levels separated
    # by "/", fields by ":", e.g. model.teacher.pyramid_levels=32:4:1/32:none:1 ("none" = default).
    pyramid_levels: tuple[tuple[int, int | None, int], ...] | None = None
    num_experts: int = 0             # > 0: the Interaction Arch is a mixture of Wukong experts
    top_k: int = 1                   # experts per sample (<= num_experts)
    capacity_factor: float | None = None   # None: no drops ("none" in overrides)
    lb_coef: float = 0.01            # weight of the experts' load-balancing loss
    cross_layer_attention: bool = True   # Wukong layer inputs attend over earlier layers' outputs
    head_towers: str = "per_surface"     # multi-domain head: "per_surface" or "shared"
    # the transformer FFN activation (pyramid and InterFormer Sequence Arch):
    # "gelu" (exact, erf), "gelu_tanh" (the tanh approximation: 12% less time than exact
    # GELU for a [659072, 512] -> 1024 -> 512 FFN's forward + backward on an H200, whose
    # erf XLA expands into a long f32 polynomial), "relu" or "silu"
    ffn_activation: str = "gelu"
    # biases of the pyramid's per-token Linears (block-attention projections, FFNs, pooling
    # attention): XLA adds each bias in a pass of its own over the [tokens, width] output
    # and reduces it again for the gradient (cuBLASLt's bias epilogue is not used)
    token_bias: bool = True


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
    """Next-item retrieval (model.kind="retrieval": gemjax.models.retrieval,
    gemjax.train.retrieval)."""

    negatives: int = 0     # 0: full softmax over the item table; N: N uniform rows per device per step
    temperature: float = 1.0   # logits = user . item / temperature
    l2norm: bool = False   # l2-normalise user and item vectors (cosine logits)
    dropout: float = 0.2   # dropout on the input tokens while training
    # user tower: "softmax": SequenceEncoder (model.attention, causal); "hstu": HSTU blocks
    # (gemjax.layers.hstu; GDPA SiLU, gated)
    encoder: str = "softmax"
    hstu_dropout: float = 0.2        # "hstu": dropout on each block's gated attention output
    # "hstu": relative attention bias added to the logits before the SiLU: "none" (position
    # from model.rope and the recency embedding only; the GDPA kernel), "position" (a learned
    # logit per head and distance i - j), "position+time" (plus one per log-bucketed time
    # gap; needs per-event timestamps, which no schema sequence carries yet)
    hstu_rel_bias: str = "none"


@dataclasses.dataclass(frozen=True)
class StudentConfig:
    """Distillation students (model.kind="student": gemjax.models.student)."""

    arch: str = "dlrm"       # "dlrm" (pairwise dots + MLP) or "wukong" (small Wukong + MLP)
    width: int = 0           # token width; 0: model.dim (else looked-up rows are projected)
    recent: int = 8          # newest events of each sequence's short summary
    teacher_repr_dim: int = 0        # E of the teacher features the batch carries (0: none)


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """FP8 GEMMs per region (gemjax.precision.policy; region names separated by "+").

    gem1b's step on one H200: 189.7 ms BF16, 270.6 ms FP8 (the quantize passes outweigh
    the faster GEMMs; 203.1 ms with regions=wukong+interformer; docs/precision.md).
    """

    format: str = "bf16"          # "bf16": every GEMM in model.dtype; "fp8": the regions' linears in FP8
    # format=fp8: the regions whose linears run in FP8
    regions: str = "wukong+interformer+attn_proj+sequence"
    exclude: str = "heads+last"  # regions (or "last": the last layer) kept in model.dtype
    # "rowwise", "tensor" or "blocked" (1x128 / 128x128 scales), or "delayed": per-tensor
    # scales from the amaxes of the last amax_history steps (gemjax.precision.delayed; the
    # histories live in the train state's "fp8_meta")
    scaling: str = "rowwise"
    amax_history: int = 16       # scaling=delayed: steps of amax history per operand
    margin: int = 0              # scaling=delayed: scales get 2**margin headroom
    grad_fmt: str = "e5m2"       # dy's format in dgrad / wgrad: "e5m2" or "e4m3"
    wgrad_dtype: str = "fp8"         # weight-gradient GEMM: "fp8", "bf16" or "f32"
    fast_accum: str = "none"     # "forward": the forward GEMMs in FP8 fast accumulation
    # format=fp8 with FSDP-sharded kernels: which FP8 linears' kernels the train step
    # gathers as FP8 bits (quantized once per step with the GEMM's scales) instead of float32
    # (gemjax.precision.fsdp.all_gather_fp8_weight; docs/precision.md). "exact": under the
    # tensor and blocked scalings (one quantization of w serves forward and dgrad, so the step
    # is unchanged); "always": rowwise too (its dgrad re-quantizes the gathered weight per row);
    # "off": every kernel gathered in float32
    gather: str = "exact"


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
    qk_norm: bool = True         # LayerNorm on queries and keys of the sequence attention
    rope: bool = True                # RoPE on sequence self-attention ("block" always rotates)
    # the sequence encoders' LayerNorms (gemjax.layers.sequence): "xla" (nnx.LayerNorm),
    # "pallas" (kernels.layer_norm's Triton kernels, one pass each way; interpret mode off GPU)
    # or "auto" (pallas on a GPU, xla elsewhere). The same parameters each way
    norm_impl: str = "xla"
    # the full GEM teacher's own fields (kind="teacher")
    teacher: TeacherConfig = TeacherConfig()
    # next-item retrieval (kind="retrieval")
    retrieval: RetrievalConfig = RetrievalConfig()
    # distillation students (kind="student")
    student: StudentConfig = StudentConfig()
    # FP8 GEMMs per region
    precision: PrecisionConfig = PrecisionConfig()


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1_000           # train steps of the run
    seed: int = 0                # seed of the data order, the parameters and dropout
    # duplicate sum + row-wise Adagrad of the touched rows: "xla", or "pallas" (one fused
    # kernel: 1.20 vs 1.93 ms per lookup + update step on one H200, benchmarks/bench_sparse.py;
    # inside the h200 teacher's step on one H200 128.2 vs 128.9 ms, so "xla",
    # which runs everywhere, stays the default; interpret mode, slow, off GPU)
    sparse_update_impl: str = "xla"
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


@dataclasses.dataclass(frozen=True)
class SparseConfig:
    """The embedding tables' performance knobs (gemjax.sparse; the same function each way)."""

    # sparse all_to_all capacity picked per step from the unique ids (EmbeddingCollection
    # exchange_buckets = routing.DEFAULT_EXCHANGE_BUCKETS), and replicas of a local table
    # copy all-gathering unique rows only (sync_buckets). On in the h200 preset (its
    # 1-GPU step: 132 ms with both, 159 ms without); off here so small CPU runs keep
    # one compiled step (the branches are fixed per batch, PlannedStep)
    exchange_buckets: bool = False
    # replicas of a local table copy all-gather unique rows only
    sync_buckets: bool = False
    # their branches fixed per batch before the step (PlannedStep) instead of a lax.switch
    # around collectives inside it, which XLA:GPU runs as a host-synced conditional
    fixed_branches: bool = True
    # pin sparse activations and their gradients to row-major (EmbeddingCollection
    # row_major): else XLA:GPU may lay a sequence stack out feature-major and transpose
    # every per-id gradient (15 ms of the 2-GPU h200 step); false for A/B runs
    row_major: bool = True
    # sorted duplicate sum of the sparse grads (routing.sum_duplicates): auto (the Pallas
    # kernel kernels.segment_sum on GPU, XLA's segment_sum elsewhere), xla or pallas
    segment_sum: str = "auto"
    # one-hot duplicate sums (routing.onehot_sums; 0 = off): an unpooled local table whose
    # unique bucket holds <= this many rows sums its per-id grads as
    # one_hot(row's unique index)^T @ grads, read in their own order (no row gather)
    onehot_rows: int = 0
    # dtype of the looked-up rows per id (sequence tokens, single ids) the model reads:
    # "table" (the table's float32) or "model" (model.dtype: a bfloat16 model then gets
    # bfloat16 gradients per id, half the bytes through the duplicate sum and its concat)
    act_dtype: str = "table"


@dataclasses.dataclass(frozen=True)
class DenseOptimConfig:
    """The dense params' optimizer and learning-rate schedule (gemjax.train.optim)."""

    # any optax optimizer taking a learning_rate (adam, adamw, adagrad, sgd, lamb, lion,
    # ...), after clipping the global gradient norm to clip_norm (0: no clip)
    name: str = "adam"
    lr: float = 4e-3             # peak learning rate
    # "warmup_cosine" (to lr * final_lr_scale at train.steps), "warmup_constant"
    # or "constant"
    schedule: str = "warmup_cosine"
    warmup_steps: int = 100      # linear warm-up of the learning rate
    final_lr_scale: float = 0.05  # warmup_cosine ends at lr times this
    clip_norm: float = 10.0      # global gradient-norm clip (0: none)
    weight_decay: float = 0.0        # for optimizers that take one (adamw, lamb, lion)


@dataclasses.dataclass(frozen=True)
class SparseOptimConfig:
    """The embedding tables' optimizer (gemjax.train.optim.SPARSE_OPTIMIZERS)."""

    # "rowwise_adagrad", "adagrad", "sgd" or "lazy_adam"
    name: str = "rowwise_adagrad"
    lr: float = 0.5              # learning rate


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The optimizers (gemjax.train.optim builds them)."""

    dense: DenseOptimConfig = DenseOptimConfig()      # dense params
    sparse: SparseOptimConfig = SparseOptimConfig()   # embedding tables



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
    sparse: SparseConfig = SparseConfig()
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
    event (vocabularies from d.synthetic, width model.dim, strict bounds); sparse features
    SPARSE_FEATURES (item_cat reads table category); num_dense dense features;
    sequences SEQUENCES, each of SEQUENCE_FIELDS (item, cat -> category, event), capped
    at seq_cap; num_surfaces x num_tasks logits."""
    d = d.synthetic
    vocab = {"user": d.vocab_user, "segment": d.vocab_segment, "context": d.vocab_context,
             "item": d.vocab_item, "category": d.num_categories, "event": d.num_event_types}
    fields = tuple(EventField(f, SYNTHETIC_FIELD_TABLES[f]) for f in SEQUENCE_FIELDS)
    return FeatureSchema(
        tables=tuple(Table(name, v) for name, v in vocab.items()),
        sparse=tuple(SparseFeature(f, SYNTHETIC_SPARSE_TABLES[f]) for f in SPARSE_FEATURES),
        dense=tuple(f"dense{i}" for i in range(d.num_dense)),
        sequences=tuple(SequenceFeature(q, fields, d.seq_cap) for q in SEQUENCES),
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
SECTIONS = ("data", "model", "train", "parallel", "optim", "sparse")

# Field paths of the flat config (the one section level a run's config.json held before the
# sub-records) -> the field's path now. apply_overrides and config_from_dict read each old
# path as its new one; --helpconfig lists them.
ALIASES: dict[str, str] = {
    "data.num_surfaces":             "data.synthetic.num_surfaces",
    "data.num_tasks":                "data.synthetic.num_tasks",
    "data.vocab_user":               "data.synthetic.vocab_user",
    "data.vocab_segment":            "data.synthetic.vocab_segment",
    "data.vocab_context":            "data.synthetic.vocab_context",
    "data.vocab_item":               "data.synthetic.vocab_item",
    "data.num_categories":           "data.synthetic.num_categories",
    "data.num_event_types":          "data.synthetic.num_event_types",
    "data.num_dense":                "data.synthetic.num_dense",
    "data.zipf":                     "data.synthetic.zipf",
    "data.seq_median":               "data.synthetic.seq_median",
    "data.seq_sigma":                "data.synthetic.seq_sigma",
    "data.seq_cap":                  "data.synthetic.seq_cap",
    "data.first_order":              "data.synthetic.first_order",
    "data.item_bias":                "data.synthetic.item_bias",
    "data.fm":                       "data.synthetic.fm",
    "data.dense_signal":             "data.synthetic.dense_signal",
    "data.clicks_signal":            "data.synthetic.clicks_signal",
    "data.views_signal":             "data.synthetic.views_signal",
    "data.drift_every":              "data.drift.every",
    "data.drift_strength":           "data.drift.strength",
    "data.popularity_shift":         "data.drift.popularity_shift",
    "data.new_id_rate":              "data.drift.new_id_rate",
    "data.drift_start":              "data.drift.start",
    "model.interformer_layers":      "model.teacher.interformer_layers",
    "model.summary_tokens":          "model.teacher.summary_tokens",
    "model.cls_tokens":              "model.teacher.cls_tokens",
    "model.pma_tokens":              "model.teacher.pma_tokens",
    "model.recent_tokens":           "model.teacher.recent_tokens",
    "model.pyramid_levels":          "model.teacher.pyramid_levels",
    "model.num_experts":             "model.teacher.num_experts",
    "model.top_k":                   "model.teacher.top_k",
    "model.capacity_factor":         "model.teacher.capacity_factor",
    "model.lb_coef":                 "model.teacher.lb_coef",
    "model.cross_layer_attention":   "model.teacher.cross_layer_attention",
    "model.head_towers":             "model.teacher.head_towers",
    "model.ffn_activation":          "model.teacher.ffn_activation",
    "model.token_bias":              "model.teacher.token_bias",
    "model.retrieval_negatives":     "model.retrieval.negatives",
    "model.retrieval_temperature":   "model.retrieval.temperature",
    "model.retrieval_l2norm":        "model.retrieval.l2norm",
    "model.retrieval_dropout":       "model.retrieval.dropout",
    "model.retrieval_encoder":       "model.retrieval.encoder",
    "model.hstu_dropout":            "model.retrieval.hstu_dropout",
    "model.hstu_rel_bias":           "model.retrieval.hstu_rel_bias",
    "model.student_arch":            "model.student.arch",
    "model.student_width":           "model.student.width",
    "model.student_recent":          "model.student.recent",
    "model.teacher_repr_dim":        "model.student.teacher_repr_dim",
    "model.precision":               "model.precision.format",
    "model.fp8_regions":             "model.precision.regions",
    "model.fp8_exclude":             "model.precision.exclude",
    "model.fp8_scaling":             "model.precision.scaling",
    "model.fp8_amax_history":        "model.precision.amax_history",
    "model.fp8_margin":              "model.precision.margin",
    "model.fp8_grad_fmt":            "model.precision.grad_fmt",
    "model.wgrad_dtype":             "model.precision.wgrad_dtype",
    "model.fp8_fast_accum":          "model.precision.fast_accum",
    "model.fp8_gather":              "model.precision.gather",
    "train.sparse_exchange_buckets": "sparse.exchange_buckets",
    "train.sparse_sync_buckets":     "sparse.sync_buckets",
    "train.sparse_fixed_branches":   "sparse.fixed_branches",
    "train.sparse_row_major":        "sparse.row_major",
    "train.sparse_segment_sum":      "sparse.segment_sum",
    "train.sparse_onehot_rows":      "sparse.onehot_rows",
    "train.sparse_act_dtype":        "sparse.act_dtype",
    "train.dense_lr":                "optim.dense.lr",
    "train.warmup_steps":            "optim.dense.warmup_steps",
    "train.sparse_lr":               "optim.sparse.lr",
    "optim.dense":                   "optim.dense.name",
    "optim.schedule":                "optim.dense.schedule",
    "optim.final_lr_scale":          "optim.dense.final_lr_scale",
    "optim.clip_norm":               "optim.dense.clip_norm",
    "optim.weight_decay":            "optim.dense.weight_decay",
    "optim.sparse":                  "optim.sparse.name",
}


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
    sequence. A path of ALIASES (the flat config's) sets the field it names now. Unknown
    fields are errors."""
    if not overrides:
        return cfg
    if isinstance(overrides, str):
        overrides = parse_overrides(overrides)
    for path, value in overrides.items():
        path = ALIASES.get(path, path)
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
        if dataclasses.is_dataclass(old):
            known = ", ".join(f.name for f in dataclasses.fields(old))
            raise ValueError(f"override {path!r}: {path} is a record of fields ({known}); "
                             f"set {path}.<field>=value")
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
    d, m, s, dr = cfg.data, cfg.model, cfg.data.synthetic, cfg.data.drift
    checks = [
        *_source_checks(d, cfg.features),
        *_negatives_checks(d),
        (d.batch_size >= 1, f"data.batch_size must be >= 1, got {d.batch_size}"),
        (s.num_surfaces >= 1 and s.num_tasks >= 1,
         "data.synthetic.num_surfaces and data.synthetic.num_tasks must be >= 1"),
        (10 <= s.vocab_user <= 10**9, f"data.synthetic.vocab_user must be in [10, 1e9], got {s.vocab_user}"),
        (s.vocab_item >= s.num_categories, "data.synthetic.vocab_item must be >= data.synthetic.num_categories"),
        (min(s.vocab_segment, s.vocab_context) >= 2,
         "data.synthetic.vocab_segment and data.synthetic.vocab_context must be >= 2"),
        (1 <= s.seq_cap <= 16_384, f"data.synthetic.seq_cap must be in [1, 16384], got {s.seq_cap}"),
        (s.seq_median > 0 and s.seq_sigma >= 0,
         "data.synthetic.seq_median must be > 0 and data.synthetic.seq_sigma >= 0"),
        (d.recent >= 1, "data.recent must be >= 1"),
        (dr.every >= 0, f"data.drift.every must be >= 0, got {dr.every}"),
        (dr.start >= 0, f"data.drift.start must be >= 0, got {dr.start}"),
        (0.0 <= dr.strength <= 1.0, f"data.drift.strength must be in [0, 1], got {dr.strength}"),
        (dr.popularity_shift >= 0, f"data.drift.popularity_shift must be >= 0, got {dr.popularity_shift}"),
        (0.0 <= dr.new_id_rate <= 1.0, f"data.drift.new_id_rate must be in [0, 1], got {dr.new_id_rate}"),
        (m.kind in ("gem", "teacher", "lr", "retrieval", "student"),
         f"model.kind must be gem, teacher, lr, retrieval or student, got {m.kind!r}"),
        *_student_checks(m),
        *_retrieval_checks(m, cfg.sparse),
        (m.attention in ("block", "softmax", "gdpa"), f"model.attention must be block, softmax or gdpa, got {m.attention!r}"),
        (m.dtype in ("float32", "bfloat16"), f"model.dtype must be float32 or bfloat16, got {m.dtype!r}"),
        (m.precision.gather in ("exact", "always", "off"),
         f"model.precision.gather must be exact, always or off, got {m.precision.gather!r}"),
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
        (cfg.sparse.act_dtype in ("table", "model"),
         f"sparse.act_dtype must be table or model, got {cfg.sparse.act_dtype!r}"),
        (cfg.sparse.segment_sum in ("auto", "xla", "pallas"),
         f"sparse.segment_sum must be auto, xla or pallas, got {cfg.sparse.segment_sum!r}"),
        (cfg.sparse.onehot_rows >= 0,
         f"sparse.onehot_rows must be >= 0 (0 = off), got {cfg.sparse.onehot_rows}"),
        *_train_checks(cfg.train, cfg.optim),
        *_optim_checks(cfg.optim),
        *_selection_checks(cfg),
        *_steps_per_call_checks(cfg),
        *_teacher_checks(m.teacher, m.norm_impl),
        *_feature_checks(cfg),
        *_remat_checks(cfg),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(f"config {cfg.name!r}: {msg}")


MAX_LR = 100.0     # larger learning rates are typos (1e30), not settings


def _train_checks(t: TrainConfig, o: OptimConfig) -> list[tuple[bool, str]]:
    """Intervals >= 1 (0 would divide by zero after compile); learning rates finite in
    [0, MAX_LR] (NaN fails every comparison)."""
    out = [(getattr(t, f) >= 1, f"train.{f} must be >= 1, got {getattr(t, f)}")
           for f in ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints")]
    out.append((o.dense.warmup_steps >= 0,
                f"optim.dense.warmup_steps must be >= 0, got {o.dense.warmup_steps}"))
    out += [(0.0 <= lr <= MAX_LR,
             f"optim.{f}.lr must be a finite number in [0, {MAX_LR:g}], got {lr}")
            for f, lr in (("dense", o.dense.lr), ("sparse", o.sparse.lr))]
    return out


def _optim_checks(o: OptimConfig) -> list[tuple[bool, str]]:
    """Names the optimizers know; clip and decay finite and >= 0 (the dense name is
    checked against optax by gemjax.train.optim when the Trainer is built)."""
    dn, sp = o.dense, o.sparse
    return [
        (dn.schedule in ("warmup_cosine", "warmup_constant", "constant"),
         f"optim.dense.schedule must be warmup_cosine, warmup_constant or constant, got {dn.schedule!r}"),
        (sp.name in ("rowwise_adagrad", "adagrad", "sgd", "lazy_adam"),
         f"optim.sparse.name must be rowwise_adagrad, adagrad, sgd or lazy_adam, got {sp.name!r}"),
        (bool(dn.name) and dn.name.isidentifier(),
         f"optim.dense.name must name an optax optimizer (adam, adamw, ...), got {dn.name!r}"),
        (0.0 <= dn.clip_norm < math.inf,
         f"optim.dense.clip_norm must be finite and >= 0, got {dn.clip_norm}"),
        (0.0 <= dn.weight_decay < math.inf,
         f"optim.dense.weight_decay must be finite and >= 0, got {dn.weight_decay}"),
        (0.0 <= dn.final_lr_scale <= 1.0,
         f"optim.dense.final_lr_scale must be in [0, 1], got {dn.final_lr_scale}"),
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
    boundary falls between two calls)."""
    k = cfg.train.steps_per_call
    if k < 1:
        return [(False, f"train.steps_per_call must be >= 1, got {k}")]
    out = [(getattr(cfg.train, f) % k == 0,
            f"train.{f} ({getattr(cfg.train, f)}) must be a multiple of train.steps_per_call "
            f"({k}): the loop logs, evaluates, checkpoints and stops between calls of {k} steps")
           for f in ("steps", "log_every", "eval_every", "checkpoint_every", "valid_every")]
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
    s = d.synthetic
    return [(f.num_surfaces == s.num_surfaces and f.num_tasks == s.num_tasks,
             f"features has {f.num_surfaces} surfaces x {f.num_tasks} tasks, data.synthetic."
             f"num_surfaces x num_tasks is {s.num_surfaces} x {s.num_tasks} (the evaluator counts "
             f"those)")]


def _student_checks(m: ModelConfig) -> list[tuple[bool, str]]:
    st = m.student
    return [(st.arch in ("dlrm", "wukong"),
             f"model.student.arch must be dlrm or wukong, got {st.arch!r}"),
            (st.width >= 0, f"model.student.width must be >= 0, got {st.width}"),
            (st.recent >= 1, f"model.student.recent must be >= 1, got {st.recent}"),
            (st.teacher_repr_dim >= 0,
             f"model.student.teacher_repr_dim must be >= 0, got {st.teacher_repr_dim}")]


def _retrieval_checks(m: ModelConfig, sp: SparseConfig) -> list[tuple[bool, str]]:
    on, r = m.kind == "retrieval", m.retrieval
    return [(r.negatives >= 0,
             f"model.retrieval.negatives must be >= 0, got {r.negatives}"),
            (r.temperature > 0,
             f"model.retrieval.temperature must be > 0, got {r.temperature}"),
            (0.0 <= r.dropout < 1.0,
             f"model.retrieval.dropout must be in [0, 1), got {r.dropout}"),
            (r.encoder in ("softmax", "hstu"),
             f"model.retrieval.encoder must be softmax or hstu, got {r.encoder!r}"),
            (0.0 <= r.hstu_dropout < 1.0,
             f"model.retrieval.hstu_dropout must be in [0, 1), got {r.hstu_dropout}"),
            (r.hstu_rel_bias in ("none", "position", "position+time"),
             f"model.retrieval.hstu_rel_bias must be none, position or position+time, got "
             f"{r.hstu_rel_bias!r}"),
            (not on or r.encoder == "hstu" or r.hstu_rel_bias == "none",
             f"model.retrieval.hstu_rel_bias={r.hstu_rel_bias} needs model.retrieval.encoder=hstu, "
             f"got {r.encoder!r}"),
            (not on or r.encoder == "hstu" or m.attention in ("softmax", "gdpa"),
             f"model.kind=retrieval needs causal attention: model.attention softmax or gdpa, "
             f"got {m.attention!r}"),
            (not on or m.use_sequences,
             "model.kind=retrieval reads the event sequence: model.use_sequences must be true"),
            # the scored item rows are ids of no batch, so no per-batch sparse branch plan
            (not on or not (sp.exchange_buckets or sp.sync_buckets),
             "model.kind=retrieval runs with sparse.exchange_buckets and "
             "sparse.sync_buckets off")]


FFN_ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
NORM_IMPLS = ("xla", "pallas", "auto")


def _teacher_checks(m: TeacherConfig, norm_impl: str) -> list[tuple[bool, str]]:
    levels = m.pyramid_levels or ()
    return [
        (m.interformer_layers >= 1,
         f"model.teacher.interformer_layers must be >= 1, got {m.interformer_layers}"),
        (m.summary_tokens >= 1, f"model.teacher.summary_tokens must be >= 1, got {m.summary_tokens}"),
        (min(m.cls_tokens, m.pma_tokens, m.recent_tokens) >= 0
         and m.cls_tokens + m.pma_tokens + m.recent_tokens > 0,
         f"model.teacher.cls_tokens ({m.cls_tokens}), model.teacher.pma_tokens ({m.pma_tokens}) "
         f"and model.teacher.recent_tokens ({m.recent_tokens}) must be >= 0 with a positive sum"),
        (m.num_experts >= 0, f"model.teacher.num_experts must be >= 0, got {m.num_experts}"),
        (m.num_experts == 0 or 1 <= m.top_k <= m.num_experts,
         f"model.teacher.top_k ({m.top_k}) must be in [1, model.teacher.num_experts={m.num_experts}]"),
        (m.capacity_factor is None or m.capacity_factor > 0,
         f"model.teacher.capacity_factor must be > 0 or none, got {m.capacity_factor}"),
        (m.lb_coef >= 0, f"model.teacher.lb_coef must be >= 0, got {m.lb_coef}"),
        (m.ffn_activation in FFN_ACTIVATIONS,
         f"model.teacher.ffn_activation must be one of {FFN_ACTIVATIONS}, got {m.ffn_activation!r}"),
        (norm_impl in NORM_IMPLS,
         f"model.norm_impl must be one of {NORM_IMPLS}, got {norm_impl!r}"),
        (m.head_towers in ("per_surface", "shared"),
         f"model.teacher.head_towers must be per_surface or shared, got {m.head_towers!r}"),
        (m.pyramid_levels is None or (
            len(levels) >= 1 and all(len(lv) == 3 for lv in levels)
            and all(b >= 1 and n >= 0 and (p is None or p >= 1) for b, p, n in levels)
            and all(p is not None for _, p, _ in levels[:-1])),
         f"model.teacher.pyramid_levels must be none or (block>=1, pooled>=1 or None, layers>=0) "
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


def nest_flat_fields(d: dict) -> dict:
    """d (asdict's form of a Config, e.g. a run's config.json) with every field at a path
    of ALIASES moved to the path it names now (a value that is already a sub-record's dict
    stays: that is the current form). A flat file's dict comes out equal to
    dataclasses.asdict of the Config it holds."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
    moved = []
    for section, fields in d.items():
        if not isinstance(fields, dict):
            continue
        for name, value in fields.items():
            new = ALIASES.get(f"{section}.{name}")
            if new is not None and not isinstance(value, dict):
                del out[section][name]
                moved.append((new, value))
    for new, value in moved:
        *parents, leaf = new.split(".")
        node = out
        for p in parents:
            node[p] = dict(node.get(p) or {})
            node = node[p]
        node.setdefault(leaf, value)
    return out


def _record_from_json(cls: type, d: Any, path: str):
    """The dataclass `cls` from its asdict form `d`, sub-records recursively; fields missing
    take their defaults; ValueError naming an unknown field or a value of the wrong type."""
    if not isinstance(d, dict):
        raise ValueError(f"config: {path} must be an object of fields, got {d!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    bad = set(d) - fields
    if bad:
        raise ValueError(f"config: {path} has no fields {sorted(bad)}; "
                         f"known: {', '.join(sorted(fields))}")
    return cls(**{k: (_record_from_json(hints[k], v, f"{path}.{k}") if dataclasses.is_dataclass(hints[k])
                      else _from_json(v, hints[k], f"{path}.{k}")) for k, v in d.items()})


def config_from_dict(d: dict) -> Config:
    """The Config that `dataclasses.asdict(cfg)` (a run's WORKDIR/config.json) came from.

    Fields missing from `d` take their defaults; an unknown section or field, or a
    value of the wrong type, is a ValueError naming it. The result is validated.
    A field at a path of ALIASES (the flat config.json of earlier runs) is read at the
    path it names now, so such a file gives the same Config.
    A "features" schema equal to the synthetic stream's for `data` (what train() records
    for a synthetic config without one) comes back as features=None, so it keeps
    following `data`.
    """
    unknown = set(d) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise ValueError(f"config: unknown sections {sorted(unknown)}; known: name, "
                         f"{', '.join(SECTIONS)}, features")
    d = nest_flat_fields(d)
    kw: dict[str, Any] = {}
    if "name" in d:
        kw["name"] = _from_json(d["name"], str, "name")
    if d.get("features") is not None:
        kw["features"] = FeatureSchema.from_dict(d["features"])
    for section in SECTIONS:
        if section in d:
            kw[section] = _record_from_json(type(getattr(Config(), section)), d[section], section)
    cfg = Config(**kw)
    if (cfg.features is not None and cfg.data.source == "synthetic"
            and cfg.features == schema_of(dataclasses.replace(cfg, features=None))):
        cfg = dataclasses.replace(cfg, features=None)
    validate(cfg)
    return cfg


def _record_paths() -> dict[type, str]:
    """{record class: its path} for every dataclass of the config tree below Config
    ("data", "data.synthetic", "model.teacher", ...)."""
    out: dict[type, str] = {}

    def walk(cls: type, path: str) -> None:
        out[cls] = path
        for name, typ in typing.get_type_hints(cls).items():
            if dataclasses.is_dataclass(typ):
                walk(typ, f"{path}.{name}")

    for section in SECTIONS:
        walk(type(getattr(Config(), section)), section)
    return out


def field_paths(record: Any = None, prefix: str = "") -> dict[str, Any]:
    """{"section.field" or "section.record.field": value} for every leaf field of the
    config tree of `record` (a Config, or a sub-record under `prefix`; default Config())."""
    record = Config() if record is None else record
    out: dict[str, Any] = {}
    names = SECTIONS if isinstance(record, Config) else [f.name for f in dataclasses.fields(record)]
    for name in names:
        value = getattr(record, name)
        path = f"{prefix}{name}"
        if dataclasses.is_dataclass(value):
            out.update(field_paths(value, f"{path}."))
        else:
            out[path] = value
    return out


def field_help() -> dict[str, str]:
    """{"path": help} for every leaf field of the config tree (field_paths): the comment on
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
    classes = {cls.__name__: (cls, path) for cls, path in _record_paths().items()}
    out = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.ClassDef) and node.name in classes):
            continue
        cls, path = classes[node.name]
        hints = typing.get_type_hints(cls)
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            if dataclasses.is_dataclass(hints[item.target.id]):
                continue          # a sub-record: its fields have their own help
            above, n = [], item.lineno - 1
            while n in comments and lines[n - 1].lstrip().startswith("#"):
                above.insert(0, comments[n].strip("- "))
                n -= 1
            parts = [p for p in (*above, comments.get(item.lineno, "")) if p]
            out[f"{path}.{item.target.id}"] = " ".join(parts)
    return out


def describe_fields(cfg: Config) -> str:
    """Every leaf field of cfg's tree, one per line: `path = value  (type) help`, then the
    ALIASES (old path -> path), for --helpconfig."""
    helps = field_help()
    hints = {path: typing.get_type_hints(cls) for cls, path in _record_paths().items()}
    rows = []
    for path, value in field_paths(cfg).items():
        record, _, name = path.rpartition(".")
        typ = hints[record][name]
        typ = getattr(typ, "__name__", str(typ))
        rows.append(f"{path} = {value!r}  ({typ})  {helps.get(path, '')}".rstrip())
    rows.append("")
    rows.append("aliases (the flat config's paths, accepted in overrides and config.json):")
    rows += [f"{old} -> {new}" for old, new in ALIASES.items()]
    return "\n".join(rows)
