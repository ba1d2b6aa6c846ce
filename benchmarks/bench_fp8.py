"""BF16 against FP8 (gemjax.precision.gemm) on a preset's linear-layer GEMMs, then its train step.

    python -m benchmarks.bench_fp8 --config=h200 \\
        --override=model.kind=teacher,model.dim=512,model.wukong_mlp=4096,data.batch_size=1024 \\
        --out=fp8.json

1. GEMMs: the forward linear GEMMs x [M, K] @ w [K, N] of the BF16 train step of --config
   (read from its StableHLO, lowered but not compiled, with tiny embedding tables:
   dot_generals contracting x's last axis with a 2-D w's first, no batch axes), one row per
   distinct (M, K, N) with its count, the --max_shapes of most FLOPs; or --shapes
   MxKxN[:count],... as given. Each runs as BF16 (lax.dot_general, bf16 out), FP8
   row-wise, per-tensor, K-blocked and row-wise with the forward's fast accumulation
   (fp8_dot), and as the FP8 GEMMs alone (bf16 out) on operands
   quantized beforehand in the K-major layouts fp8_dot gives them, forward and
   forward+backward (y, dx, dw for a fixed dy): ms,
   TFLOP/s (2MKN forward, 6MKN forward + backward), speedup over BF16, max error relative
   to max |y| of the float32 product, and the compiled program's custom calls (cuBLASLt
   FP8 or not) and fusion count.
2. Step (unless --nostep): the whole jitted train step (bench_step's timing: fixed
   batches, device only) with --override, then with --override plus each --fp8_override
   (default model.precision=fp8; the flag repeated times several FP8 variants: the first
   is the JSON's step "fp8", every one is in its "fp8_variants" with its speedup).

On GPU both precisions run with XLA's Triton GEMM fusions off (every GEMM on cuBLAS /
cuBLASLt, gemjax.train.runtime.FP8_GEMM_FLAGS, as the train runs' FP8 steps; --triton_gemm
keeps them).

3. Limit table (--limit): the train step in BF16 and in FP8 under each --scalings
   (model.fp8_scaling: rowwise, tensor, blocked, delayed), every linear GEMM shape of the
   step (all of them unless --max_shapes) timed as BF16 and as the FP8 GEMMs alone on
   operands quantized beforehand, and in one table:
     bf16 / fp8 <scaling>   measured steps, ms and speedup over BF16
     fp8 quantization free  the BF16 step with each linear GEMM's forward+backward time
                            (count x bf16 fwd+bwd ms) replaced by the pre-quantized FP8
                            GEMMs' (count x fp8_gemm_only fwd+bwd ms): the FP8 step if
                            every quantize pass cost nothing (derived, not a timed step)
     Amdahl bound           1 / ((1 - f) + f / s): f the GEMM share of the BF16 step
                            (--gemm_share, or measured: sum of count x bf16 fwd+bwd ms
                            over the BF16 step), s the pre-quantized FP8 GEMMs' speedup
                            (sum of bf16 over sum of fp8_gemm_only fwd+bwd ms); and the
                            bound with FP8 GEMMs free, 1 / (1 - f)
   The linear GEMMs are the dot_generals of a 2-D weight (attention's batched products and
   the einsum token mixes are not among them: they count in "rest").

--variants times a subset of the fp8_dot variants (under --limit, none unless given);
--nogemms times the two train steps only. Each variant's line and each step's line is printed as it is timed, and --out (JSON,
every figure) is rewritten after each, so a run cut short still reports. Prints the table
last. --smoke: the tiny preset's
teacher, 2 shapes (or --max_shapes), 1 timed iteration (a CPU check of the script, not a
measurement).
"""

from __future__ import annotations

import json
import re
import time

from absl import app, flags

flags.DEFINE_string("config", "h200", "preset")
flags.DEFINE_string("override", "model.kind=teacher", "section.field=value,... (both runs)")
flags.DEFINE_multi_string("fp8_override", ["model.precision=fp8"],
                          "added to --override for an FP8 step; repeat the flag to time several "
                          "(e.g. --fp8_override=model.precision=fp8 "
                          "--fp8_override=model.precision=fp8,model.wgrad_dtype=bf16)")
flags.DEFINE_integer("iters", 20, "timed calls per GEMM / steps per train step")
flags.DEFINE_integer("batches", 3, "distinct batches cycled through in the step timing")
flags.DEFINE_integer("max_shapes", 6, "keep the N shapes of most FLOPs (count x 2MKN; 0: all; "
                     "--smoke: 2 unless given)")
flags.DEFINE_string("shapes", "", "MxKxN[:count],... to time instead of the config's shapes")
flags.DEFINE_bool("step", True, "also time the whole train step BF16 vs FP8")
flags.DEFINE_bool("gemms", True, "time the GEMMs (--nogemms: the train steps only)")
flags.DEFINE_bool("triton_gemm", False, "keep XLA's Triton GEMM fusions (default: the FP8 runs' "
                  "cuBLAS-only GEMMs, gemjax.train.runtime.FP8_GEMM_FLAGS, for both precisions; "
                  "with Triton, gem1b's FP8 step compiles for over 10 minutes)")
flags.DEFINE_bool("smoke", False, "tiny shapes, 1 iteration: a CPU check of the script")
flags.DEFINE_string("out", "", "JSON output path")
flags.DEFINE_string("compile_cache", "", "persistent compilation cache directory (gemjax.train."
                    "runtime; '' off): a rerun loads the compiled steps, and on GPU XLA's "
                    "autotuning, instead of redoing them (compile_s is then the load time)")
flags.DEFINE_list("variants", [], "FP8 variants of fp8_dot to time (default all: fp8_rowwise, "
                  "fp8_tensor, fp8_blocked, fp8_rowwise_fast, fp8_delayed; under --limit none); "
                  "bf16 and the FP8 GEMMs alone always run")
flags.DEFINE_bool("limit", False, "the limit table: BF16 step, FP8 step per --scalings, FP8 with "
                  "quantization free, Amdahl bound (module docstring)")
flags.DEFINE_list("scalings", ["rowwise", "tensor", "blocked", "delayed"],
                  "--limit: the model.fp8_scaling of each FP8 step timed")
flags.DEFINE_float("gemm_share", 0.0, "--limit: the linear GEMMs' share of the BF16 step (e.g. "
                   "from a profile); 0: measured from the GEMM table")

FP8_VARIANTS = ("fp8_rowwise", "fp8_tensor", "fp8_blocked", "fp8_rowwise_fast", "fp8_delayed")
_DOT = re.compile(r"stablehlo\.dot_general [^,]+, [^,]+, contracting_dims = \[(\d+)\] x \[0\], "
                  r"precision = [^:]*: \(tensor<([0-9x]+)x\w+>, tensor<(\d+)x(\d+)x\w+>\)")


def linear_gemms(hlo_text: str) -> dict[tuple[int, int, int], int]:
    """{(M, K, N): count} of the linear forward GEMMs in lowered StableHLO text."""
    out: dict[tuple[int, int, int], int] = {}
    for line in hlo_text.splitlines():
        if "batching_dims" in line:
            continue
        m = _DOT.search(line)
        if not m:
            continue
        lhs = [int(d) for d in m.group(2).split("x")]
        k, n = int(m.group(3)), int(m.group(4))
        if int(m.group(1)) != len(lhs) - 1 or lhs[-1] != k:
            continue
        rows = 1
        for d in lhs[:-1]:
            rows *= d
        key = (rows, k, n)
        out[key] = out.get(key, 0) + 1
    return out


def step_gemms(cfg) -> dict[tuple[int, int, int], int]:
    """linear_gemms of cfg's BF16 train step, lowered (not compiled) with tiny embedding
    tables: the dense GEMM shapes do not depend on the vocabularies. The state is abstract
    (Trainer.abstract_state: shapes, dtypes and shardings): lowering needs no values,
    and drawing them eagerly costs more than the lowering."""
    import dataclasses

    from gemjax.data.feeding import Feeder
    from gemjax.data.synthetic import SyntheticStream
    from gemjax.train.step import Trainer

    d = cfg.data
    s = d.synthetic
    small = dataclasses.replace(cfg, data=dataclasses.replace(d, synthetic=dataclasses.replace(
        s, vocab_user=min(s.vocab_user, 1_000), vocab_item=min(s.vocab_item, max(1_000, s.num_categories)))),
        model=dataclasses.replace(cfg.model, precision=dataclasses.replace(cfg.model.precision, format="bf16")))
    trainer = Trainer.create(small)
    state = trainer.abstract_state()
    feeder = Feeder(SyntheticStream(small.data, 0).shard_batch, trainer.mesh)
    batch = feeder.to_device(feeder.host_batch(0)[0])
    return linear_gemms(trainer.make_train_step().lower(state, batch).as_text())


def _time(fn, args, iters):
    import jax
    jax.block_until_ready(fn(*args))                      # compile + warm-up
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        r = fn(*args)
    jax.block_until_ready(r)
    return (time.perf_counter() - t0) / iters


def bench_gemm(m, k, n, iters, seed=0, fp8_variants=FP8_VARIANTS):
    """One GEMM shape: {variant: {fwd_ms, fwdbwd_ms, fwd_tflops, fwdbwd_tflops, rel_err}}
    for bf16, fp8_variants and fp8_gemm_only; each variant's line printed as it is timed."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from gemjax.precision.delayed import fp8_dot_delayed, next_history
    from gemjax.precision.gemm import Recipe, fp8_dot

    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (m, n), jnp.float32).astype(jnp.bfloat16)
    ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    scale = float(jnp.max(jnp.abs(ref)))
    recipes = {"fp8_rowwise": Recipe("rowwise"), "fp8_tensor": Recipe("tensor"),
               "fp8_blocked": Recipe("blocked"),
               "fp8_rowwise_fast": Recipe("rowwise", fast_accum="forward")}
    variants = {"bf16": lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())))}
    variants.update({v: (lambda a, b, r=recipes[v]: fp8_dot(a, b, r)) for v in fp8_variants
                     if v in recipes})
    if "fp8_delayed" in fp8_variants:    # scales from a history holding this data's amaxes
        amax = jnp.stack([jnp.max(jnp.abs(t.astype(jnp.float32))) for t in (x, w, dy)])
        hist = next_history(jnp.zeros((3, 16), jnp.float32), amax)
        variants["fp8_delayed"] = lambda a, b: fp8_dot_delayed(a, b, hist, Recipe())
    res: dict = {}
    for name, f in variants.items():
        t0 = time.perf_counter()
        fwd = jax.jit(f).lower(x, w).compile()
        fb = jax.jit(lambda a, b, g, f=f: (lambda y, vjp: (y,) + vjp(g))(*jax.vjp(f, a, b)))
        fb = fb.lower(x, w, dy).compile()
        compile_s = time.perf_counter() - t0
        t_f = _time(fwd, (x, w), iters)
        t_fb = _time(fb, (x, w, dy), iters)
        print(f"  {m}x{k}x{n} {name}: {t_f * 1e3:.3f} / {t_fb * 1e3:.3f} ms (compiled in "
              f"{compile_s:.1f} s)", flush=True)
        err = float(jnp.max(jnp.abs(fwd(x, w).astype(jnp.float32) - ref))) / max(scale, 1e-30)
        hlo = fb.as_text()
        res[name] = {"fwd_ms": t_f * 1e3, "fwdbwd_ms": t_fb * 1e3,
                     "fwd_tflops": 2 * m * k * n / t_f / 1e12,
                     "fwdbwd_tflops": 6 * m * k * n / t_fb / 1e12, "rel_err": err,
                     # what the compiled forward+backward calls: the GEMM custom calls
                     # (cuBLAS / cuBLASLt FP8 on GPU) and how many fusions
                     "custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo))),
                     "fusions": len(re.findall(r"= \S+ fusion\(", hlo))}
    # the FP8 GEMMs alone, on operands quantized beforehand (E4M3 x, w; E5M2 dy), each in
    # the K-major layout the GEMM takes (as fp8_dot quantizes them): forward qx [M, K] .
    # qw^T [N, K]; forward+backward also dgrad qdy [M, N] . qw [K, N] and wgrad
    # qx^T [K, M] . qdy^T [N, M]; bf16 out and precision HIGHEST, as in fp8_dot's default
    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    q = (x.astype(e4), w.T.astype(e4), w.astype(e4), dy.astype(e5), x.T.astype(e4),
         dy.T.astype(e5))
    mm = lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())),           # noqa: E731
                                      precision=lax.Precision.HIGHEST,
                                      preferred_element_type=jnp.bfloat16)
    g_f = jax.jit(mm).lower(*q[:2]).compile()
    g_fb = jax.jit(lambda qx, qwt, qw, qd, qxt, qdt: (mm(qx, qwt), mm(qd, qw), mm(qxt, qdt))
                   ).lower(*q).compile()
    t_f, t_fb = _time(g_f, q[:2], iters), _time(g_fb, q, iters)
    res["fp8_gemm_only"] = {"fwd_ms": t_f * 1e3, "fwdbwd_ms": t_fb * 1e3,
                            "fwd_tflops": 2 * m * k * n / t_f / 1e12,
                            "fwdbwd_tflops": 6 * m * k * n / t_fb / 1e12, "rel_err": float("nan"),
                            "custom_calls": sorted(set(re.findall(
                                r'custom_call_target="([^"]+)"', g_fb.as_text()))),
                            "fusions": len(re.findall(r"= \S+ fusion\(", g_fb.as_text()))}
    print(f"  {m}x{k}x{n} fp8_gemm_only: {t_f * 1e3:.3f} / {t_fb * 1e3:.3f} ms", flush=True)
    for name in tuple(fp8_variants) + ("fp8_gemm_only",):
        res[name]["fwd_speedup"] = res["bf16"]["fwd_ms"] / res[name]["fwd_ms"]
        res[name]["fwdbwd_speedup"] = res["bf16"]["fwdbwd_ms"] / res[name]["fwdbwd_ms"]
    return res


def bench_step(cfg, iters, n_batches):
    """bench_step's timing of cfg's train step: {step_ms, compile_s, loss}."""
    import jax

    from gemjax.data.feeding import Feeder
    from gemjax.data.synthetic import SyntheticStream
    from gemjax.train import tracking
    from gemjax.train.step import Trainer

    trainer = Trainer.create(cfg)
    state = trainer.init_state(0)
    feeder = Feeder(SyntheticStream(cfg.data, 0).shard_batch, trainer.mesh)
    batches = [feeder.to_device(feeder.host_batch(i)[0]) for i in range(n_batches)]
    step = trainer.make_train_step()
    t0 = time.perf_counter()
    with tracking.Heartbeat("compiling the train step", 60):
        step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    nb = len(batches)
    for i in range(nb):
        state, met = step(state, batches[i], next_batch=batches[(i + 1) % nb])
    jax.block_until_ready(met)
    t0 = time.perf_counter()
    for i in range(iters):
        state, met = step(state, batches[i % nb], next_batch=batches[(i + 1) % nb])
    jax.block_until_ready((state, met))
    return {"step_ms": (time.perf_counter() - t0) / iters * 1e3, "compile_s": compile_s,
            "loss": float(met["loss"])}, None


def _join(*parts: str) -> str:
    return ",".join(p for p in parts if p)


def main(argv):
    del argv
    from gemjax.train import runtime
    runtime.enable_gpu_graphs()
    if not flags.FLAGS.triton_gemm:   # both steps and every GEMM: the FP8 runs' flags (runtime)
        runtime.enable_fp8_gemm_flags("fp8")
    import jax

    try:
        runtime.enable_compile_cache(flags.FLAGS.compile_cache)
    except ValueError as e:
        raise app.UsageError(f"--compile_cache: {e}")

    from gemjax.config import get_config

    f = flags.FLAGS
    config, override, iters = f.config, f.override, f.iters
    bad = sorted(set(f.variants) - set(FP8_VARIANTS))
    if bad:
        raise app.UsageError(f"--variants: unknown {bad} (have {', '.join(FP8_VARIANTS)})")
    if not f.gemms and not f.step:
        raise app.UsageError("--nogemms with --nostep leaves nothing to time")
    fp8 = tuple(v for v in FP8_VARIANTS if (not f.variants and not f.limit) or v in f.variants)
    bad = sorted(set(f.scalings) - {"rowwise", "tensor", "blocked", "delayed"})
    if bad:
        raise app.UsageError(f"--scalings: unknown {bad} (have rowwise, tensor, blocked, delayed)")
    if not 0.0 <= f.gemm_share < 1.0:
        raise app.UsageError(f"--gemm_share: {f.gemm_share} is not in [0, 1)")
    if f.limit and not (f.gemms and f.step):
        raise app.UsageError("--limit needs the GEMMs and the steps (no --nogemms / --nostep)")
    fp8_overrides = ([f"model.precision=fp8,model.fp8_scaling={sc}" for sc in f.scalings]
                     if f.limit else f.fp8_override)
    if f.smoke:
        config, iters = "tiny", 1
    cfg = get_config(config, override)
    res = {"config": config, "override": override, "fp8_override": fp8_overrides,
           "device_kind": jax.devices()[0].device_kind, "gemms": [], "step": {}}

    def dump():
        if f.out:
            with open(f.out, "w") as fh:
                json.dump(res, fh, indent=1)

    if not f.gemms:
        shapes = {}
    elif f.shapes:
        shapes = {}
        for item in f.shapes.split(","):
            dims, _, count = item.partition(":")
            shapes[tuple(int(d) for d in dims.split("x"))] = int(count or 1)
    else:
        t0 = time.perf_counter()
        shapes = step_gemms(cfg)
        print(f"{len(shapes)} GEMM shapes from the lowered step in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    order = sorted(shapes.items(), key=lambda kv: -kv[1] * kv[0][0] * kv[0][1] * kv[0][2])
    res["all_shapes"] = [{"m": m, "k": k, "n": n, "count": c} for (m, k, n), c in order]
    if f.limit and not f["max_shapes"].present:
        keep = len(order)            # the GEMM share needs every shape
    else:
        keep = 2 if f.smoke and not f["max_shapes"].present else (f.max_shapes or len(order))
    res["variants"] = list(fp8)
    for (m, k, n), count in order[:keep]:
        r = bench_gemm(m, k, n, iters, fp8_variants=fp8)
        res["gemms"].append({"m": m, "k": k, "n": n, "count": count, **r})
        print(f"gemm {m}x{k}x{n} (x{count}): " + ", ".join(
            f"{v} {r[v]['fwd_ms']:.3f}/{r[v]['fwdbwd_ms']:.3f} ms {r[v]['custom_calls']} "
            f"{r[v]['fusions']} fusions" for v in r), flush=True)
        dump()
    if f.step:
        runs = [("bf16", "", override)] + [("fp8", fo, _join(override, fo)) for fo in fp8_overrides]
        res["step"]["fp8_variants"] = []
        for name, fo, ov in runs:
            st, _ = bench_step(get_config(config, ov), iters, f.batches)
            label = name if len(runs) == 2 or name == "bf16" else f"fp8 [{fo}]"
            print(f"step {label}: {st['step_ms']:.2f} ms (compiled in {st['compile_s']:.1f} s, "
                  f"loss {st['loss']:.4f})", flush=True)
            if name == "bf16":
                res["step"]["bf16"] = st
            else:
                st = {"fp8_override": fo, **st,
                      "speedup": res["step"]["bf16"]["step_ms"] / st["step_ms"]}
                res["step"]["fp8_variants"].append(st)
                if len(res["step"]["fp8_variants"]) == 1:
                    res["step"]["fp8"] = st
                    res["step"]["speedup"] = st["speedup"]
            dump()
    # totals over the shapes, weighted by their counts
    tot = {v: {p: sum(g["count"] * g[v][f"{p}_ms"] for g in res["gemms"]) for p in ("fwd", "fwdbwd")}
           for v in ("bf16",) + fp8 + ("fp8_gemm_only",)}
    res["gemm_totals_ms"] = tot
    dump()
    if res["gemms"]:
        short = {"fp8_rowwise": "row", "fp8_tensor": "tensor", "fp8_blocked": "blocked",
                 "fp8_rowwise_fast": "rowfast", "fp8_delayed": "delayed", "fp8_gemm_only": "gemm"}
        hdr = f"{'M':>8} {'K':>5} {'N':>5} {'#':>3} | {'bf16 f / fb ms':>17} {'err':>7}"
        for v in fp8 + ("fp8_gemm_only",):
            hdr += f" | {short[v] + ' f / fb ms':>17} {'x f':>5} {'x fb':>5} {'err':>7}"
        print(hdr)
        for g in res["gemms"]:
            b = g["bf16"]
            line = (f"{g['m']:>8} {g['k']:>5} {g['n']:>5} {g['count']:>3} | "
                    f"{b['fwd_ms']:>8.3f}/{b['fwdbwd_ms']:<8.3f} {b['rel_err']:>7.1e}")
            for v in fp8 + ("fp8_gemm_only",):
                r = g[v]
                line += (f" | {r['fwd_ms']:>8.3f}/{r['fwdbwd_ms']:<8.3f} {r['fwd_speedup']:>5.2f} "
                         f"{r['fwdbwd_speedup']:>5.2f} {r['rel_err']:>7.1e}")
            print(line)
        for v, t in tot.items():
            print(f"total {v:<12} fwd {t['fwd']:.3f} ms  fwd+bwd {t['fwdbwd']:.3f} ms  "
                  f"(x{tot['bf16']['fwd'] / max(t['fwd'], 1e-12):.2f} / "
                  f"x{tot['bf16']['fwdbwd'] / max(t['fwdbwd'], 1e-12):.2f} vs bf16)")
    if f.step:
        s = res["step"]
        for v in s["fp8_variants"]:
            tag = "" if len(s["fp8_variants"]) == 1 else f" [{v['fp8_override']}]"
            print(f"train step: bf16 {s['bf16']['step_ms']:.2f} ms  fp8{tag} {v['step_ms']:.2f} ms  "
                  f"speedup x{v['speedup']:.3f}  (loss {s['bf16']['loss']:.4f} / {v['loss']:.4f})")

    if f.limit:
        res["limit"] = limit_table(res, f.gemm_share)
        dump()
        print_limit(res["limit"])


def limit_table(res: dict, gemm_share: float = 0.0) -> dict:
    """The limit table (module docstring) from a run's figures: {"rows": [{name, step_ms,
    speedup}], "gemm_share", "gemm_share_measured", "gemm_speedup", "amdahl",
    "amdahl_free"}."""
    bf16 = res["step"]["bf16"]["step_ms"]
    tot = res["gemm_totals_ms"]
    g16, g8 = tot["bf16"]["fwdbwd"], tot["fp8_gemm_only"]["fwdbwd"]
    measured = g16 / bf16
    share = gemm_share or measured
    s = g16 / max(g8, 1e-12)
    rows = [{"name": "bf16", "step_ms": bf16}]
    for v in res["step"]["fp8_variants"]:
        sc = v["fp8_override"].rpartition("fp8_scaling=")[2].split(",")[0] or v["fp8_override"]
        rows.append({"name": f"fp8 {sc}", "step_ms": v["step_ms"]})
    rows.append({"name": "fp8 quantization free", "step_ms": bf16 - g16 + g8})
    for r in rows:
        r["speedup"] = bf16 / r["step_ms"]
    return {"rows": rows, "gemm_share": share, "gemm_share_measured": measured,
            "gemm_speedup": s, "amdahl": 1.0 / ((1.0 - share) + share / s),
            "amdahl_free": 1.0 / (1.0 - share)}


def print_limit(t: dict) -> None:
    print(f"{'limit table':<26} {'step ms':>9} {'x bf16':>7}")
    for r in t["rows"]:
        print(f"{r['name']:<26} {r['step_ms']:>9.2f} {r['speedup']:>7.3f}")
    print(f"{'Amdahl bound':<26} {'':>9} {t['amdahl']:>7.3f}  (GEMM share {t['gemm_share']:.3f}, "
          f"measured {t['gemm_share_measured']:.3f}; FP8 GEMM speedup {t['gemm_speedup']:.2f})")
    print(f"{'Amdahl, FP8 GEMMs free':<26} {'':>9} {t['amdahl_free']:>7.3f}")


if __name__ == "__main__":
    app.run(main)
