"""The named presets: a Config per name, each a complete run's settings.

    from gemjax.config import get_config
    cfg = get_config("tiny", overrides="train.steps=50")      # PRESETS["tiny"], validated

Presets on the synthetic stream leave Config.features None: their schema is the
stream's, a function of their DataConfig (gemjax.config.synthetic_schema), so a
data.* override reshapes it. Presets on real files (source "parquet") carry the schema
those files were converted with (FRAPPE_SCHEMA, ML1M_SCHEMA) as Config.features, built
once here: no model, layer or cost model reads a data source to learn its features.

Importing this module fills gemjax.config.PRESETS (the package's __init__ imports it,
so every importer of gemjax.config sees the presets). It imports only gemjax.config
and gemjax.features.
"""

from __future__ import annotations

import dataclasses

from gemjax.config import (PRESETS, Config, DataConfig, DenseOptimConfig, ModelConfig, OptimConfig,
                           RetrievalConfig, SparseConfig, SparseOptimConfig,
                           SyntheticConfig, TeacherConfig, TrainConfig)
from gemjax.features import EventField, FeatureSchema, SequenceFeature, SparseFeature, Table

# Frappe CTR as experiments/convert_frappe.py writes it (its frappe_schema on the real
# files): the 10 context fields, each a sparse feature of one shared table of the 5,382
# feature ids, one task.
FRAPPE_DIR = "/tmp/gemjax-data/frappe"      # convert_frappe.py --out (outside the repository)
FRAPPE_FIELDS = ("user", "item", "daytime", "weekday", "isweekend", "homework", "cost",
                 "weather", "country", "city")
FRAPPE_SCHEMA = FeatureSchema(tables=(Table("feature", 5_382),),
                              sparse=tuple(SparseFeature(n, "feature") for n in FRAPPE_FIELDS),
                              tasks=("label",))

# MovieLens-1M next-item retrieval as experiments/convert_movielens.py --tasks=retrieval
# --train_positions=1 writes it (its movielens_schema on the real files): per user one
# train row (history = the 200 newest train items before the last one, item = the last
# train item) and one test row (history = the 200 newest train items, item = the
# leave-last-out test item); the item table (3,953 rows, 3,706 items occur) is shared by
# the history and the candidate.
ML1M_DIR = "/tmp/gemjax-data/ml-1m"        # convert_movielens.py --out (outside the repository)
ML1M_USER_FIELDS = ("user", "gender", "age", "occupation")
ML1M_SCHEMA = FeatureSchema(
    tables=(Table("user", 6_040), Table("gender", 2), Table("age", 7), Table("occupation", 21),
            Table("item", 3_953), Table("genre", 18)),
    sparse=tuple(SparseFeature(n, n) for n in ML1M_USER_FIELDS + ("item", "genre")),
    sequences=(SequenceFeature("history", (EventField("item", "item"), EventField("genre", "genre")),
                               max_len=200),),
    tasks=("label",))

PRESETS.update({
    "tiny": Config(
        name="tiny",
        data=DataConfig(batch_size=64, recent=8, eval_batches=2,
                        synthetic=SyntheticConfig(vocab_user=1_000, vocab_item=400, seq_median=8,
                                                  seq_cap=32)),
        model=ModelConfig(dim=8, wukong_layers=1, fmb_tokens=4, lcb_tokens=4, fm_rank=4,
                          wukong_mlp=(16,), head_mlp=(16,)),
        train=TrainConfig(steps=20, log_every=5, eval_every=10, checkpoint_every=10, baselines=False),
        optim=OptimConfig(dense=DenseOptimConfig(lr=2e-3, warmup_steps=5),
                          sparse=SparseOptimConfig(lr=0.1))),
    "small": Config(name="small"),
    # MovieLens-1M ranking (experiments/convert_movielens.py --tasks=ranking; docs/results.md):
    # run with --features=<out>/ranking/schema.json and data.source=parquet,
    # data.train_path=..., data.eval_path=..., data.eval_batches=0 (every eval row once; a
    # preset validates as it stands, without a schema, so it keeps the synthetic source). One
    # epoch of the --train_positions=5 file (151,000 rows) is 295 steps of 512; the shuffle
    # window holds the whole file (rows are sorted by user). Model selection: validation AUC on
    # valid.parquet beside data.train_path (the converter's valid split) every 50 steps, the
    # best step kept in WORKDIR/best and tested, 3 evals without improvement stop the run
    # (as the preset stands, on the synthetic source: the held-out synthetic stream).
    "movielens_rank": Config(
        name="movielens_rank",
        data=DataConfig(batch_size=512, shuffle_window=1 << 20, recent=8, valid_path="valid.parquet"),
        model=ModelConfig(kind="teacher", dim=32, wukong_layers=1, fmb_tokens=4, lcb_tokens=4,
                          fm_rank=4, wukong_mlp=(64,), head_mlp=(64,)),
        train=TrainConfig(steps=295, log_every=50, eval_every=295, checkpoint_every=295,
                          baselines=False, valid_every=50, select_metric="auc", patience=3),
        optim=OptimConfig(dense=DenseOptimConfig(lr=1e-2, warmup_steps=20),
                          sparse=SparseOptimConfig(lr=0.5))),
    "h200": Config(
        name="h200",
        data=DataConfig(batch_size=4096, recent=64, eval_batches=8, host_workers=8,
                        synthetic=SyntheticConfig(vocab_user=10_000_000, vocab_item=1_000_000,
                                                  num_categories=64, seq_median=256, seq_cap=4096)),
        model=ModelConfig(dim=128, block=64, seq_layers=2, seq_heads=4, dense_tokens=4, wukong_layers=4,
                          fmb_tokens=32, lcb_tokens=32, fm_rank=32, wukong_mlp=(1024,),
                          head_mlp=(512,), dtype="bfloat16"),
        train=TrainConfig(steps=2_000, log_every=50, eval_every=500, baselines=False),
        optim=OptimConfig(dense=DenseOptimConfig(lr=1e-3), sparse=SparseOptimConfig(lr=0.1)),
        sparse=SparseConfig(exchange_buckets=True, sync_buckets=True)),
    # GEM-shaped teacher for one H200 (issue: GEM scale). 1,253M dense parameters (965M in
    # the 8 Wukong experts, 288M outside), width 512 (4 heads of 128), two event sequences of
    # log-normal lengths (median 1,024, sigma 0.6, cap 8,192; about 2,330 events per sample),
    # ~51 GFLOP of model FLOPs per sample per train step (gemjax.perf.model_size prints both
    # counts; tests/test_gem1b.py pins them). The FLOPs sit in big GEMMs: the pyramid's
    # per-token projections and FFN over ~2.4M tokens a step, Wukong MLPs 1,024 -> 8,192 ->
    # 8,192 in each expert (top 2 of 8, capacity 1.25: 320 rows per expert, not 8 x the
    # batch), summary MLPs 6,656 -> 8,192 and per-surface heads 6,144 -> 4,096. capacity_slack
    # 1.05: the packed buffers hold 1.32M tokens per sequence per step (1.19M expected). On a
    # GPU the sequence encoders' norms run on kernels.layer_norm (norm_impl auto), and the
    # category (64 rows) and event (4) tables sum their per-id grads as one-hot matmuls.
    "gem1b": Config(
        name="gem1b",
        data=DataConfig(batch_size=1024, recent=64, capacity_slack=1.05, eval_batches=4,
                        host_workers=12,
                        synthetic=SyntheticConfig(vocab_user=2_000_000, vocab_item=1_000_000,
                                                  num_categories=64, seq_median=1024,
                                                  seq_sigma=0.6, seq_cap=8192)),
        model=ModelConfig(kind="teacher", dim=512, block=64, seq_heads=4, dense_tokens=8,
                          wukong_layers=2, fmb_tokens=16, lcb_tokens=16, fm_rank=32,
                          wukong_mlp=(8192,), head_mlp=(4096,), dtype="bfloat16", norm_impl="auto",
                          teacher=TeacherConfig(num_experts=8, top_k=2, capacity_factor=1.25,
                                                ffn_activation="gelu_tanh", token_bias=False)),
        train=TrainConfig(steps=300, log_every=20, eval_every=300, checkpoint_every=1_000_000,
                          baselines=False),
        optim=OptimConfig(dense=DenseOptimConfig(lr=3e-4, warmup_steps=50),
                          sparse=SparseOptimConfig(lr=0.05)),
        sparse=SparseConfig(act_dtype="model", onehot_rows=128)),
    # MovieLens-1M next-item retrieval (gemjax.train.retrieval; experiments/movielens.py
    # runs it): the recipe of the standalone script's defaults that reached HR@10 0.3061
    # (docs/results.md): item dim 64, 2 causal softmax blocks of 2 heads
    # with RoPE and QK-norm, genre added to each item token, input dropout 0.2, full
    # softmax over the item table without l2-normalisation, batch 128 users, Adam 1e-3
    # on the dense params); the item table trains with row-wise Adagrad (sparse_lr). One
    # step trains every position of 128 users' histories; 48 steps are one epoch (6,040
    # rows; 4,800 steps: 100 epochs). eval: every test row (leave-last-out), full ranking,
    # history excluded. Model selection: HR@10 on valid.parquet beside data.train_path (each
    # user's last train item: experiments/convert_movielens.py writes it by default) every 480
    # steps; the best step is kept (WORKDIR/best) and tested; 3 evals without gain stop the run.
    "movielens_retrieval": Config(
        name="movielens_retrieval",
        data=DataConfig(batch_size=128, source="parquet",
                        train_path=f"{ML1M_DIR}/retrieval/train.parquet",
                        eval_path=f"{ML1M_DIR}/retrieval/test.parquet", eval_batches=0,
                        valid_path="valid.parquet", shuffle_window=1 << 20, capacity_slack=1.5),
        model=ModelConfig(kind="retrieval", dim=64, seq_layers=2, seq_heads=2, attention="softmax",
                          rope=True, qk_norm=True, retrieval=RetrievalConfig(negatives=0, dropout=0.2)),
        train=TrainConfig(steps=4_800, log_every=48, eval_every=480, checkpoint_every=480,
                          baselines=False, select_metric="hr@10", patience=3),
        optim=OptimConfig(dense=DenseOptimConfig(lr=1e-3, warmup_steps=48),
                          sparse=SparseOptimConfig(lr=0.05)),
        features=ML1M_SCHEMA),
    # Frappe CTR, GEM v0 (Wukong over the 10 field tokens: dim 32, 3 layers, FMB 6 + LCB 4
    # tokens, rank 4, FMB MLP 128, head MLP 64; experiments/frappe.py runs it over seeds).
    # Trained on train.parquet, scored on every row of test.parquet. Chosen by a validation
    # sweep (experiments/sweep.py, 3 seeds a trial, the mean holdout NE; docs/results.md):
    # dense lr 4.56e-3, sparse lr 0.1606, up to 360 steps (4 epochs of 90 batches). Model
    # selection: holdout NE (holdout.parquet beside data.train_path) every 45 steps, the best
    # step kept (WORKDIR/best) and tested, 2 evals without improvement stop the run.
    "frappe": Config(
        name="frappe",
        data=DataConfig(batch_size=512, source="parquet", train_path=f"{FRAPPE_DIR}/train.parquet",
                        eval_path=f"{FRAPPE_DIR}/test.parquet", valid_path="holdout.parquet",
                        eval_batches=0),
        model=ModelConfig(kind="gem", dim=32, wukong_layers=3, fmb_tokens=6, lcb_tokens=4,
                          fm_rank=4, wukong_mlp=(128,), head_mlp=(64,)),
        train=TrainConfig(steps=360, log_every=45, eval_every=360, checkpoint_every=180,
                          baselines=False, valid_every=45, select_metric="ne", patience=2),
        optim=OptimConfig(dense=DenseOptimConfig(lr=4.56e-3, warmup_steps=45),
                          sparse=SparseOptimConfig(lr=0.1606)),
        features=FRAPPE_SCHEMA),
})

# MovieLens-1M retrieval with an HSTU-large-shaped tower (gemjax.layers.hstu): the depth
# and width of generative-recommenders' ML-1M HSTU-large (8 blocks, 2 heads, dqk = dv = 25,
# item dim 50, dropout 0.2 on the input and on each block's gated output, batch 128 users,
# max length 200, Adam 1e-3 without warmup or weight decay), trained as measured best on
# the validation rows (docs/results.md): a full softmax over the item table at temperature
# 1 without l2-normalisation, and a constant learning rate (optim.dense.schedule), so a run
# that stops early on validation and its refit see the same rate. HSTU's own sampled softmax
# (128 negatives, l2-normalised vectors, temperature 0.05: model.retrieval.negatives=128,
# l2norm=true, temperature=0.05) learned about 10x slower here, where
# the negatives are shared by a device's tokens. Position by RoPE on Q / K plus a learned
# recency embedding on the input (HSTU: learned absolute positions and a bucketed relative
# position / time bias), attention scale 1/200; the item table trains with row-wise Adagrad
# (optim.sparse.lr). The data and selection settings are movielens_retrieval's.
PRESETS["movielens_hstu_large"] = dataclasses.replace(
    PRESETS["movielens_retrieval"], name="movielens_hstu_large",
    model=ModelConfig(kind="retrieval", dim=50, seq_layers=8, seq_heads=2, attention="gdpa",
                      rope=True, qk_norm=False,
                      retrieval=RetrievalConfig(encoder="hstu", negatives=0, temperature=1.0,
                                                l2norm=False, dropout=0.2, hstu_dropout=0.2)),
    train=dataclasses.replace(PRESETS["movielens_retrieval"].train, steps=9_600),
    optim=OptimConfig(dense=DenseOptimConfig(lr=1e-3, warmup_steps=0, schedule="constant"),
                      sparse=SparseOptimConfig(lr=0.05)))
# movielens_hstu_large with HSTU's relative attention bias in place of RoPE: each block
# learns a logit per head and relative position i - j (0..199), added before the SiLU
# (model.retrieval.hstu_rel_bias=position; the attention runs densely on the histories padded to
# 200). ML-1M's files carry no timestamps, so the time-gap part of HSTU's bias is off.
PRESETS["movielens_hstu_large_rab"] = dataclasses.replace(
    PRESETS["movielens_hstu_large"], name="movielens_hstu_large_rab",
    model=dataclasses.replace(PRESETS["movielens_hstu_large"].model, rope=False,
                              retrieval=dataclasses.replace(
                                  PRESETS["movielens_hstu_large"].model.retrieval,
                                  hstu_rel_bias="position")))
