"""Serving a model whose ids pass a frequency admission map (an online run's member).

    maps = admission_maps("runs/online/members/fresh")    # {table: AdmissionMap}
    predict = load_for_inference("runs/online/members/fresh")
    probs = predict(map_batch(raw_batch, maps, predict.cfg))     # raw ids -> rows on the host
    export_admitted("runs/online/members/fresh")          # -> .../export: takes raw ids
    probs = load_exported(".../export")(raw_batch)

An online member's run directory (gemjax.train.online, WORKDIR/members/<name>) is a
standard run whose embedding tables are indexed by table rows; its checkpoint's meta
holds, per admitted table, the map from raw ids to rows as it stood when the state was
saved: meta["admission"][table] = {"rows", "buckets", "ids": admitted raw ids ascending
[A], "own_rows": their rows [A]}. A raw id x reads

    row(x) = own_rows[i]            where ids[i] == x (an admitted id)
             bucket_of(x, buckets)  otherwise: (x * 2654435761 mod 2^32) mod buckets

(`gemjax.sparse.admission`; raw ids are int32 >= 0). `AdmissionMap` applies it on the
host (numpy, a binary search over the sorted ids); `map_batch` applies each table's map
to every feature of that table in a Batch (sparse ids and sequence fields).

`export_admitted` folds the map into the exported function: the export's inputs are raw
ids, and the function maps them with the same rule (jnp.searchsorted over the sorted
ids, the hash in uint32 arithmetic) before the lookup. The map's arrays are params of
the export, "admission/<table>/ids" and "admission/<table>/rows", int32 [rows - buckets]
(the most ids a table can admit; unused entries are ids int32 max with row -1, which no
lookup takes), so a server swaps in a newer checkpoint's tables and map together with
`ExportedModel.call` without exporting again. The manifest's features of admitted
tables say bounds "admitted" (no range check on raw ids) and manifest["admission"]
gives each table's rows, buckets, admitted count and the rule. Folded in rather than
shipped beside the export: the map and the tables are only right together (a row's
weights mean that id only under this map), so one checksummed export holds both, and a
server cannot serve raw ids through the wrong map or none.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax.numpy as jnp
import numpy as np

from gemjax.config import Config
from gemjax.data.batch import Batch
from gemjax.serve.export import export_model, feature_inputs, serving_forward
from gemjax.sparse.admission import bucket_of

RULE = "own_rows[i] where ids[i] == x, else (x * 2654435761 mod 2^32) mod buckets"
_PAD = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class AdmissionMap:
    """Raw id -> row of one table: ids int64 [A] ascending (admitted raw ids), own int32
    [A] (their rows), buckets (shared rows [0, buckets)), rows (the table's rows)."""

    rows: int
    buckets: int
    ids: np.ndarray
    own: np.ndarray

    @classmethod
    def from_meta(cls, d: Mapping) -> "AdmissionMap":
        """The map of a checkpoint meta's admission entry ({"rows", "buckets", "ids",
        "own_rows"})."""
        ids, own = np.asarray(d["ids"], np.int64), np.asarray(d["own_rows"], np.int32)
        if ids.shape != own.shape or np.any(np.diff(ids) <= 0):
            raise ValueError("admission map: ids must be ascending and as many as own_rows")
        return cls(int(d["rows"]), int(d["buckets"]), ids, own)

    def __call__(self, raw) -> np.ndarray:
        """Rows int32 shaped like `raw` (raw ids >= 0; ValueError for a negative one)."""
        raw = np.asarray(raw, np.int64)
        if raw.size and raw.min() < 0:
            raise ValueError(f"admission map: raw ids must be >= 0, got {raw.min()}")
        pos = np.minimum(np.searchsorted(self.ids, raw), max(len(self.ids) - 1, 0))
        hit = (self.ids[pos] == raw) if len(self.ids) else np.zeros(raw.shape, bool)
        own = self.own[pos] if len(self.ids) else 0
        return np.where(hit, own, bucket_of(raw, self.buckets)).astype(np.int32)

    def padded(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows) int32 [rows - buckets]: the map padded with (int32 max, -1)."""
        n = self.rows - self.buckets
        ids, own = np.full(n, _PAD, np.int32), np.full(n, -1, np.int32)
        ids[:len(self.ids)], own[:len(self.own)] = self.ids, self.own
        return ids, own


def maps_of(meta: Mapping) -> dict[str, AdmissionMap]:
    """{table: AdmissionMap} of a checkpoint meta (meta["admission"]; {} when absent)."""
    return {t: AdmissionMap.from_meta(d) for t, d in meta.get("admission", {}).items()}


def admission_maps(workdir: str, step: int | str | None = None) -> dict[str, AdmissionMap]:
    """{table: AdmissionMap} saved with checkpoint `step` of the run in `workdir` (default
    the newest; gemjax.serve.restore.pick_checkpoint); {} for a run without admission."""
    from gemjax.serve.restore import pick_checkpoint
    from gemjax.train.checkpoint import Checkpointer

    directory, step = pick_checkpoint(workdir, step)
    with Checkpointer(directory, read_only=True) as ckpt:
        return maps_of(ckpt.metadata(step)[1])


def map_batch(batch: Batch, maps: Mapping[str, AdmissionMap], cfg: Config) -> Batch:
    """`batch` (one shard, raw ids) with every feature of an admitted table mapped to rows
    (sparse ids [B]; sequence fields [T], padding tokens included: their rows are unused)."""
    sparse, seqs = dict(batch.sparse), dict(batch.sequences)
    for f, fi in feature_inputs(cfg).items():
        m = maps.get(fi["table"])
        if m is None:
            continue
        seq, _, field = f.partition(".")
        if field:
            vals = dict(seqs[seq].values)
            vals[field] = m(vals[field])
            seqs[seq] = dataclasses.replace(seqs[seq], values=vals)
        else:
            sparse[f] = m(sparse[f])
    return batch.replace(sparse=sparse, sequences=seqs)


def map_ids(raw, ids, own, buckets: int):
    """The rule on device: rows int32 of raw int32 ids >= 0, ids / own the padded map."""
    pos = jnp.minimum(jnp.searchsorted(ids, raw), ids.shape[0] - 1)
    hit = (ids[pos] == raw) & (own[pos] >= 0)
    hashed = (raw.astype(jnp.uint32) * jnp.uint32(2_654_435_761)) % jnp.uint32(buckets)
    return jnp.where(hit, own[pos], hashed.astype(jnp.int32))


def export_admitted(workdir: str, out: str | None = None, step: int | str | None = None, *,
                    batch: Batch | None = None, log: Callable[[str], None] = print, **kw) -> str:
    """export_model of the run in `workdir` with its checkpoint's admission maps folded in
    (module docstring): the exported function takes raw ids. batch: an example one-shard
    Batch fixing the shapes (raw or mapped ids: only shapes count). Other keywords go to
    export_model. Returns the export directory."""
    from gemjax.serve.inference import check_self_contained

    def extend(pred, params, ex_batch, flat_params, tables):
        check_self_contained(pred.cfg, workdir)
        maps = maps_of(pred.meta)
        feats = feature_inputs(pred.cfg)
        base = serving_forward(pred.cfg, pred.trainer.graphdef, params, ex_batch)
        flat = dict(flat_params)
        for t, m in maps.items():
            flat[f"admission/{t}/ids"], flat[f"admission/{t}/rows"] = m.padded()

        def forward(p, tabs, fb):
            fb = dict(fb)
            for fi in feats.values():
                t = fi["table"]
                if t in maps:
                    fb[fi["input"]] = map_ids(fb[fi["input"]].astype(jnp.int32),
                                              p[f"admission/{t}/ids"], p[f"admission/{t}/rows"],
                                              maps[t].buckets)
            return base({k: v for k, v in p.items() if not k.startswith("admission/")}, tabs, fb)

        admitted = {f: {**fi, "bounds": "admitted"} for f, fi in feats.items() if fi["table"] in maps}
        manifest = {"admission": {t: {"rows": m.rows, "buckets": m.buckets, "admitted": len(m.ids),
                                      "rule": RULE} for t, m in maps.items()}}
        return forward, flat, tables, admitted, manifest

    return export_model(workdir, out, step, batch=batch, log=log, extend=extend, **kw)
