"""Row order of the embedding table state: storage order (per the sharding plan) <->
logical order (row i = id i), on the host and sharded on device.

    rows = RowOrder(specs, plans, mesh)     # EmbeddingCollection.rows
    rows.to_logical(state) / rows.from_logical(host_arrays)             # host copies
    rows.logical_arrays(state) / rows.from_logical_arrays(arrays)        # sharded, jitted

State arrays are padded to Vp = a multiple of the table's shard count and sharded per
the plan (`gemjax.sparse.plans`): {unit: {"weights": [Vp, D], <optimizer state [Vp, ...]>}},
a unit being a table, or a stack of table_wise tables ("@table_wise_<i>",
`plans.stacks`). Storage row of logical id i (`plans.Layout.storage_index`): i for
"range" splits and replicated tables, s * rps + l with (s, l) = (i % S, i // S) for a
"mod" split over S shards, base + i inside the owning device's block of a stack for
table_wise tables. Logical arrays {table: {name: [L, ...]}} (L = `logical_rows`) are
what checkpoints hold, so they restore onto any mesh and plan.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gemjax.sparse import plans as plans_lib
from gemjax.sparse.specs import TableSpec

Array = Any


class RowOrder:
    """Storage <-> logical row order of one collection's table state (module docstring).

    specs: the tables; plans {table: TablePlan}; mesh: the collection's mesh.
    `units` {unit: [table, ...]} and `layouts` {table: plans.Layout} as `plans.stacks`
    gives them; `unit_of` {table: unit}.
    """

    def __init__(self, specs: Sequence[TableSpec], plans: Mapping[str, plans_lib.TablePlan],
                 mesh: Mesh):
        self.specs = {s.name: s for s in specs}
        self.plans, self.mesh = plans, mesh
        self.units, self.layouts = plans_lib.stacks(specs, plans, mesh)
        self.unit_of = {t: u for u, ts in self.units.items() for t in ts}
        self._jitted: dict[Any, Any] = {}   # logical <-> storage permutations

    def state_sharding(self, mesh: Mesh | None = None) -> dict[str, dict[str, NamedSharding]]:
        """NamedShardings of the state pytree (e.g. orbax restore targets)."""
        mesh = mesh or self.mesh
        out = {}
        for u, ts in self.units.items():
            s = self.specs[ts[0]]
            sh = NamedSharding(mesh, P(self.plans[ts[0]].storage_axes or None))
            out[u] = {"weights": sh, **{k: sh for k in s.optimizer.init_state(1, s.dim)}}
        return out

    def to_logical(self, state) -> dict[str, dict[str, np.ndarray]]:
        """Host copy of the state in logical row order, padding removed: [V, ...] per array.

        Gathers every table onto the host: for tests and small tables. Checkpoints use
        `logical_arrays` (sharded, on device).
        """
        out = {}
        for n, s in self.specs.items():
            idx = self.layouts[n].storage_index(np.arange(s.vocab))
            out[n] = {k: np.asarray(v)[idx] for k, v in state[self.unit_of[n]].items()}
        return out

    def from_logical(self, logical) -> dict[str, dict[str, Array]]:
        """Inverse of to_logical: {table: {name: [V, ...]}} -> sharded state (padding zero).

        Arrays are cast to the table / optimizer-state dtypes.
        """
        shardings, out = self.state_sharding(), {}
        for u, ts in self.units.items():
            full = {}
            for n in ts:
                s, lay = self.specs[n], self.layouts[n]
                dtypes = {"weights": np.dtype(s.dtype),
                          **{k: np.dtype(a.dtype) for k, a in s.optimizer.init_state(1, s.dim).items()}}
                idx = lay.storage_index(np.arange(s.vocab))
                for k, v in logical[n].items():
                    v = np.asarray(v).astype(dtypes[k])
                    if v.shape[0] != s.vocab:
                        raise ValueError(f"table {n!r} array {k!r}: leading dim {v.shape[0]} != vocab {s.vocab}")
                    if k not in full:
                        full[k] = np.zeros((lay.padded_vocab,) + v.shape[1:], v.dtype)
                    full[k][idx] = v
            out[u] = {k: jax.device_put(v, shardings[u][k]) for k, v in full.items()}
        return out

    def logical_rows(self, name: str) -> int:
        """Leading dim L >= V of table `name`'s logical arrays on this mesh: the padded
        vocab (a multiple of its shard count), or for a table_wise table V rounded up to a
        multiple of the devices of its model axes."""
        lay, p = self.layouts[name], self.plans[name]
        if lay.fixed_shard >= 0:
            n = plans_lib._axes_size(self.mesh, p.model_axes)
            return -(-lay.vocab // n) * n
        return lay.padded_vocab

    def logical_sharding(self) -> dict[str, dict[str, NamedSharding]]:
        """NamedShardings of `logical_arrays`: rows split like the table's storage
        (table_wise tables: over their model axes)."""
        out = {}
        for n, s in self.specs.items():
            p = self.plans[n]
            axes = p.model_axes if p.kind == "table_wise" else p.storage_axes
            sh = NamedSharding(self.mesh, P(axes or None))
            out[n] = {k: sh for k in ["weights", *s.optimizer.init_state(1, s.dim)]}
        return out

    def logical_targets(self) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
        """Shapes, dtypes and shardings of `logical_arrays` (orbax restore targets)."""
        shardings, out = self.logical_sharding(), {}
        for n, s in self.specs.items():
            rows = self.logical_rows(n)
            arrays = {"weights": jax.ShapeDtypeStruct((1, s.dim), s.dtype),
                      **s.optimizer.init_state(1, s.dim)}
            out[n] = {k: jax.ShapeDtypeStruct((rows,) + tuple(a.shape[1:]), a.dtype,
                                              sharding=shardings[n][k]) for k, a in arrays.items()}
        return out

    def _permuted(self, name: str) -> bool:
        """Whether table `name`'s storage order differs from its logical order."""
        lay = self.layouts[name]
        return lay.fixed_shard >= 0 or (lay.split == "mod" and lay.num_shards > 1)

    def logical_arrays(self, state) -> dict[str, dict[str, Array]]:
        """state (storage order) -> {table: {name: [L, ...]}} in logical row order, sharded.

        Row i < V is logical row i; L = `logical_rows(table)`, a function of the mesh.
        Rows V..L-1 are zero, except for tables stored in logical order already
        ("range" splits, replicated or one-shard tables), which are passed through
        uncopied (padding rows as stored). The others go through one jitted permutation,
        never a host copy: a "mod" split is the row-block transpose [S, Vp/S] ->
        [Vp/S, S] as one all_to_all (`_mod_permute`: about 2 shards of exchange buffers
        per device besides the input and output shards), table_wise tables a slice of
        their stack. The input is not donated.
        """
        moved = tuple(n for n in self.specs if self._permuted(n))
        out = {n: dict(state[self.unit_of[n]]) for n in self.specs if n not in moved}
        if moved:
            key = ("to_logical", moved)
            if key not in self._jitted:
                sh = self.logical_sharding()

                def convert(state):
                    return {n: {k: _storage_to_logical(a, self.layouts[n], self.logical_rows(n),
                                                       self.mesh, self.plans[n].storage_axes)
                                for k, a in state[self.unit_of[n]].items()} for n in moved}
                self._jitted[key] = jax.jit(convert, out_shardings={n: sh[n] for n in moved})
            out.update(self._jitted[key]({self.unit_of[n]: state[self.unit_of[n]] for n in moved}))
        return out

    def from_logical_arrays(self, logical) -> dict[str, dict[str, Array]]:
        """Inverse of `logical_arrays`, also from another mesh's logical arrays.

        logical {table: {name: [L', ...]}}, L' >= V any length (rows past V are
        ignored), any sharding over this mesh's devices: restore them from a checkpoint
        with `logical_targets()` (orbax pads or truncates the rows). Returns the state
        in this collection's storage order, dtypes and `state_sharding()`. Arrays of
        tables already in logical order with L' = Vp and their storage sharding are
        used as they are (padding rows as given); the rest go through one jitted
        permutation (padding rows zero) and are donated.
        """
        shardings = self.state_sharding()
        dtypes = {}
        for n, s in self.specs.items():
            dtypes[n] = {"weights": jnp.dtype(s.dtype),
                         **{k: a.dtype for k, a in s.optimizer.init_state(1, s.dim).items()}}
            if n not in logical or set(logical[n]) != set(dtypes[n]):
                raise ValueError(f"logical state of table {n!r}: expected arrays "
                                 f"{sorted(dtypes[n])}, got {sorted(logical.get(n, {}))}")
            for k, a in logical[n].items():
                if a.shape[0] < s.vocab:
                    raise ValueError(f"logical state of table {n!r} array {k!r}: {a.shape[0]} rows "
                                     f"< vocab {s.vocab}")
        out, moved = {}, []
        for u, ts in self.units.items():
            n = ts[0]
            arrays = logical[n]
            if not self._permuted(n) and all(
                    a.shape[0] == self.layouts[n].padded_vocab and a.dtype == dtypes[n][k]
                    and getattr(a, "sharding", None) is not None
                    and a.sharding.is_equivalent_to(shardings[u][k], a.ndim)
                    for k, a in arrays.items()):
                out[u] = dict(arrays)
            else:
                moved.append(u)
        if moved:
            key = ("from_logical", tuple(moved))
            if key not in self._jitted:
                def convert(logical):
                    res = {}
                    for u in moved:
                        ts = self.units[u]
                        lays = [self.layouts[t] for t in ts]
                        res[u] = {k: _logical_to_storage([logical[t][k] for t in ts], lays, self.mesh,
                                                         self.plans[ts[0]].storage_axes)
                                  .astype(dtypes[ts[0]][k]) for k in logical[ts[0]]}
                    return res
                self._jitted[key] = jax.jit(convert, out_shardings={u: shardings[u] for u in moved},
                                            donate_argnums=0)
            with warnings.catch_warnings():   # donation is best effort: shapes may differ
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                out.update(self._jitted[key]({t: dict(logical[t]) for u in moved
                                              for t in self.units[u]}))
        return {u: out[u] for u in self.units}


def _pad_rows(x: Array, rows: int) -> Array:
    """x [n, ...] -> [rows, ...]: zero rows appended, or rows past `rows` dropped."""
    if x.shape[0] >= rows:
        return x[:rows]
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _zero_past_vocab(x: Array, vocab: int, offset: Array | int = 0) -> Array:
    """Rows whose logical id (offset + row) is >= vocab set to zero."""
    ids = offset + jnp.arange(x.shape[0])
    return jnp.where((ids < vocab).reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def _mod_blocks(j: Array, m: Array, lay: plans_lib.Layout):
    """Rows of storage shard m (mod split) whose logical ids fall in logical block j.

    Logical block j holds ids [j * rps, (j + 1) * rps); storage shard m holds ids
    l * S + m at local row l. Those in block j are l in [start, start + count):
    start = clip(ceil((j * rps - m) / S), 0, rps), at most ceil(rps / S) of them.
    """
    s, rps = lay.num_shards, lay.rows_per_shard
    start = lambda jj: jnp.clip(-((m - jj * rps) // s), 0, rps)  # noqa: E731  ceil division
    return start(j), start(j + 1) - start(j)


def _mod_permute(x: Array, lay: plans_lib.Layout, mesh: Mesh, axes: tuple[str, ...],
                 to_logical: bool) -> Array:
    """A mod split's storage [Vp, ...] <-> its logical order [Vp, ...], both sharded
    P(axes) over the S storage shards: one padded all_to_all of [S, ceil(rps/S), ...]
    per device, never the table on one device. XLA:CPU temp memory per device,
    measured (1e6 x 16 table + row-wise Adagrad on 8 devices): 2.1 shards to
    logical, 3.8 storage-ward (its output may reuse the donated input). Logical
    rows >= V come out zero."""
    s, rps = lay.num_shards, lay.rows_per_shard
    cap = -(-rps // s)
    c = jnp.arange(cap)

    def body(local):                                   # [rps, ...], this device's block
        me = jax.lax.axis_index(axes)
        peers = jnp.arange(s)
        if to_logical:      # me = storage shard m, peers = logical blocks j
            start, count = _mod_blocks(peers, me, lay)
            src = start[:, None] + c[None, :]                       # [S, cap] local storage rows
            ok = c[None, :] < count[:, None]
        else:               # me = logical block j, peers = storage shards m
            start, count = _mod_blocks(me, peers, lay)
            src = (start[:, None] + c[None, :]) * s + peers[:, None] - me * rps
            ok = (c[None, :] < count[:, None]) & (src + me * rps < lay.vocab)   # rows past V: 0
        send = jnp.take(local, jnp.where(ok, src, 0), axis=0)
        send = jnp.where(ok.reshape(ok.shape + (1,) * (local.ndim - 1)), send,
                         jnp.zeros((), local.dtype))
        recv = jax.lax.all_to_all(send, axes, 0, 0)                 # recv[p] from peer p
        if to_logical:      # me = logical block j, peers = storage shards m
            start, count = _mod_blocks(me, peers, lay)
            dst = (start[:, None] + c[None, :]) * s + peers[:, None] - me * rps
        else:               # me = storage shard m, peers = logical blocks j
            start, count = _mod_blocks(peers, me, lay)
            dst = start[:, None] + c[None, :]
        ok = c[None, :] < count[:, None]
        dst = jnp.where(ok, dst, rps).reshape(-1)                   # rps: dropped
        out = jnp.zeros_like(local).at[dst].set(recv.reshape((-1,) + local.shape[1:]),
                                                mode="drop", unique_indices=True)
        return _zero_past_vocab(out, lay.vocab, me * rps) if to_logical else out

    spec = P(axes)
    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(x)


def _storage_to_logical(a: Array, lay: plans_lib.Layout, rows: int, mesh: Mesh,
                        axes: tuple[str, ...]) -> Array:
    """One table's storage array [Vp, ...] (its stack for table_wise) -> logical [rows, ...].

    Storage row of logical id i (`Layout.storage_index`): i for "range" and replicated
    tables (identity), s * rps + l with (s, l) = (i % S, i // S) for "mod" (an
    all_to_all, `_mod_permute`), a slice of the stack for table_wise tables (XLA may
    gather the stack, which fits one device by construction).
    """
    if lay.fixed_shard >= 0:
        start = lay.fixed_shard * lay.rows_per_shard + lay.base
        return _pad_rows(jax.lax.slice_in_dim(a, start, start + lay.vocab), rows)
    if lay.split == "mod" and lay.num_shards > 1:
        return _mod_permute(a, lay, mesh, axes, to_logical=True)
    return _zero_past_vocab(a, lay.vocab)


def _logical_to_storage(xs: Sequence[Array], lays: Sequence[plans_lib.Layout], mesh: Mesh,
                        axes: tuple[str, ...]) -> Array:
    """Logical arrays [>= V, ...] of the tables of one storage unit -> its storage [Vp, ...]."""
    if lays[0].fixed_shard < 0:
        (x,), (lay,) = xs, lays
        if x.shape[0] != lay.padded_vocab:
            x = _pad_rows(x[:lay.vocab], lay.padded_vocab)
        if lay.split == "mod" and lay.num_shards > 1:
            return _mod_permute(x, lay, mesh, axes, to_logical=False)
        return _zero_past_vocab(x, lay.vocab)
    out = jnp.zeros((lays[0].padded_vocab,) + xs[0].shape[1:], xs[0].dtype)
    for x, lay in zip(xs, lays):
        start = lay.fixed_shard * lay.rows_per_shard + lay.base
        out = jax.lax.dynamic_update_slice_in_dim(out, x[:lay.vocab], start, axis=0)
    return out
