"""Physical device mesh from a flag string, with each axis mapped to a network tier.

A mesh spec names the physical axes outer to inner, e.g. ``replica=2,fsdp=2,expert=2``.
Each axis belongs to one tier of the three-tier network (GEM's layout):

  ``cross_zone``  zones linked by oversubscribed RoCE   (default for ``replica``)
  ``zone``        hosts of one zone on RoCE             (default for ``fsdp``, ``sparse``)
  ``host``        GPUs of one host on NVLink            (default for ``expert``, ``tensor``)

The tier says the slowest network an axis may use: a ``host`` axis must stay inside
one host, a ``zone`` axis may span hosts. Other names need an explicit tier:
``data=4@cross_zone``. One size may be ``-1`` and is inferred from the device count.
Tiers must not get slower going inward (a ``host`` axis cannot sit outside a ``zone``
axis), because the inner axes are the ones laid out on neighbouring devices.

Device order: the innermost axes vary fastest over the devices of one host. With
several hosts each axis is split into an in-host part and a cross-host part,
filling a host from the inner axes outward (``split_over_hosts``), and the devices
are laid out as ``mesh_utils.create_hybrid_device_mesh`` does (``device_array``).

Axis types default to ``Auto`` (the train step uses ``jit`` with explicit in/out
shardings plus ``with_sharding_constraint``); ``axis_types="explicit"`` gives
sharding-in-types meshes. Note ``jax.make_mesh`` defaults to Explicit.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

TIERS = ("cross_zone", "zone", "host")  # outer (slow) to inner (fast)
DEFAULT_TIERS = {
    "replica": "cross_zone",
    "data": "cross_zone",
    "fsdp": "zone",
    "sparse": "zone",
    "expert": "host",
    "tensor": "host",
}
_AXIS_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(-?\d+)(?:@([a-z_]+))?$")


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    """One physical axis: name, size (-1 = inferred), network tier."""

    name: str
    size: int
    tier: str


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Physical axes ordered outer to inner."""

    axes: tuple[MeshAxis, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(a.tier for a in self.axes)

    def with_shape(self, shape: Sequence[int]) -> "MeshSpec":
        return MeshSpec(tuple(MeshAxis(a.name, int(s), a.tier) for a, s in zip(self.axes, shape)))

    def __str__(self) -> str:
        return ",".join(f"{a.name}={a.size}@{a.tier}" for a in self.axes)


def parse_mesh_spec(text: str) -> MeshSpec:
    """Parse ``name=size[@tier],...`` (outer to inner) into a MeshSpec; sizes may hold one -1."""
    if not text or not text.strip():
        raise ValueError("--mesh: empty mesh spec; expected e.g. 'replica=2,fsdp=2,expert=2'")
    axes = []
    for part in text.split(","):
        part = part.strip()
        m = _AXIS_RE.match(part)
        if not m:
            raise ValueError(f"--mesh: cannot parse {part!r} in {text!r}; expected name=size or name=size@tier")
        name, size, tier = m.group(1), int(m.group(2)), m.group(3)
        if tier is None:
            if name not in DEFAULT_TIERS:
                raise ValueError(
                    f"--mesh: axis {name!r} has no default tier; write {name}={size}@<tier> "
                    f"with tier in {TIERS} (defaults exist for {sorted(DEFAULT_TIERS)})")
            tier = DEFAULT_TIERS[name]
        if tier not in TIERS:
            raise ValueError(f"--mesh: axis {name!r}: unknown tier {tier!r}; use one of {TIERS}")
        if size == 0 or size < -1:
            raise ValueError(f"--mesh: axis {name!r}: size must be >= 1 or -1 (inferred), got {size}")
        axes.append(MeshAxis(name, size, tier))
    names = [a.name for a in axes]
    if len(set(names)) != len(names):
        raise ValueError(f"--mesh: repeated axis name in {text!r}")
    if sum(a.size == -1 for a in axes) > 1:
        raise ValueError(f"--mesh: at most one axis may be -1 (inferred), got {text!r}")
    order = [TIERS.index(a.tier) for a in axes]
    if order != sorted(order):
        raise ValueError(
            f"--mesh: tiers must go from slow to fast, outer to inner ({' > '.join(TIERS)}); got "
            + ", ".join(f"{a.name}@{a.tier}" for a in axes))
    return MeshSpec(tuple(axes))


def _factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """All ordered k-tuples of positive ints with product n."""
    if k == 0:
        return [()] if n == 1 else []
    out = []
    for d in range(1, n + 1):
        if n % d == 0:
            out += [(d,) + rest for rest in _factorizations(n // d, k - 1)]
    return out


def split_over_hosts(spec: MeshSpec, devices_per_host: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Split each axis into (in-host, cross-host) factors, filling a host from the inner axes out.

    Returns (ici_shape, dcn_shape) with ici * dcn == spec.shape elementwise and
    prod(ici) == devices_per_host. Raises ValueError if a ``host``-tier axis would
    span hosts or the axes do not tile a host exactly.
    """
    shape = spec.shape
    if any(s < 1 for s in shape):
        raise ValueError(f"mesh {spec}: resolve -1 sizes before splitting over hosts")
    room = devices_per_host
    ici = [1] * len(shape)
    for i in reversed(range(len(shape))):
        ici[i] = math.gcd(shape[i], room)
        room //= ici[i]
    dcn = [s // c for s, c in zip(shape, ici)]
    for a, d in zip(spec.axes, dcn):
        if a.tier == "host" and d != 1:
            raise ValueError(
                f"mesh {spec}: axis {a.name!r} has tier 'host' (NVLink) but would span {d} hosts "
                f"of {devices_per_host} devices each")
    if room != 1:
        raise ValueError(
            f"mesh {spec}: the axes do not tile a host of {devices_per_host} devices "
            f"(in-host factors {tuple(ici)}, {room}x left over)")
    return tuple(ici), tuple(dcn)


def valid_shapes(spec: MeshSpec, n_devices: int, devices_per_host: int | None = None) -> list[tuple[int, ...]]:
    """Every shape for spec's axes (names and tiers kept) that fits n_devices hosts-wise."""
    devices_per_host = devices_per_host or n_devices
    out = []
    for shape in _factorizations(n_devices, len(spec.axes)):
        try:
            split_over_hosts(spec.with_shape(shape), devices_per_host)
        except ValueError:
            continue
        out.append(shape)
    return out


def _suggest(spec: MeshSpec, n_devices: int, devices_per_host: int, limit: int = 12) -> str:
    shapes = valid_shapes(spec, n_devices, devices_per_host)
    if not shapes:
        return f"no shape of axes {spec.names} fits {n_devices} devices"
    txt = "; ".join(",".join(f"{n}={s}" for n, s in zip(spec.names, sh)) for sh in shapes[:limit])
    more = f" (+{len(shapes) - limit} more)" if len(shapes) > limit else ""
    return f"shapes that fit {n_devices} devices ({devices_per_host} per host): {txt}{more}"


def resolve_mesh_spec(spec: MeshSpec | str, n_devices: int, devices_per_host: int | None = None) -> MeshSpec:
    """Fill the -1 axis and check the shape against the device count and host size."""
    if isinstance(spec, str):
        spec = parse_mesh_spec(spec)
    devices_per_host = devices_per_host or n_devices
    if n_devices % devices_per_host:
        raise ValueError(f"{n_devices} devices do not split into hosts of {devices_per_host}")
    known = math.prod(s for s in spec.shape if s != -1)
    if -1 in spec.shape:
        if n_devices % known:
            raise ValueError(
                f"mesh {spec}: the fixed axes (product {known}) do not divide {n_devices} devices; "
                + _suggest(spec, n_devices, devices_per_host))
        spec = spec.with_shape([n_devices // known if s == -1 else s for s in spec.shape])
    elif known != n_devices:
        raise ValueError(
            f"mesh {spec}: product {known} != {n_devices} devices; " + _suggest(spec, n_devices, devices_per_host))
    try:
        split_over_hosts(spec, devices_per_host)
    except ValueError as e:
        raise ValueError(f"{e}; " + _suggest(spec, n_devices, devices_per_host)) from None
    return spec


def device_array(spec: MeshSpec, devices: Sequence[jax.Device], devices_per_host: int | None = None) -> np.ndarray:
    """Devices arranged in spec.shape so inner axes stay inside a host (spec must be resolved).

    One host (the default when all devices belong to one process and no
    devices_per_host is given): ``mesh_utils.create_device_mesh`` order.
    One process per host: ``mesh_utils.create_hybrid_device_mesh`` with processes as
    granules. Otherwise (several processes per host, or hosts simulated inside one
    process): devices sorted host-major by (process_index, id) and cut into hosts of
    ``devices_per_host`` (consecutive process ids share a host, as cluster
    launchers assign them), laid out the same way: each axis index is
    ``cross_host_index * in_host_size + in_host_index``.
    """
    devices = list(devices)
    if math.prod(spec.shape) != len(devices):
        raise ValueError(f"mesh {spec} needs {math.prod(spec.shape)} devices, got {len(devices)}")
    per_proc: dict[int, int] = {}
    for d in devices:
        per_proc[d.process_index] = per_proc.get(d.process_index, 0) + 1
    if len(set(per_proc.values())) != 1:
        raise ValueError(f"processes hold different device counts {per_proc}; gemjax needs equal hosts")
    n_local = next(iter(per_proc.values()))
    if len(per_proc) == 1 and devices_per_host in (None, len(devices)):
        if devices[0].platform == "cpu":
            return np.array(devices, dtype=object).reshape(spec.shape)
        return mesh_utils.create_device_mesh(spec.shape, devices, allow_split_physical_axes=True)
    per_host = devices_per_host or n_local
    if per_host % n_local and n_local % per_host:
        raise ValueError(f"devices_per_host={per_host} does not align with {n_local} devices per process")
    ici, dcn = split_over_hosts(spec, per_host)
    if per_host == n_local and len(per_proc) > 1:  # one process per host
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    k = len(spec.shape)
    arr = np.empty(len(ordered), dtype=object)
    arr[:] = ordered
    arr = arr.reshape(dcn + ici).transpose([j for i in range(k) for j in (i, k + i)])
    return arr.reshape(spec.shape)


def build_mesh(spec: MeshSpec | str, devices: Sequence[jax.Device] | None = None, *,
               axis_types: str = "auto", devices_per_host: int | None = None) -> Mesh:
    """A jax Mesh for ``spec`` (a MeshSpec or flag string) over ``devices`` (default all).

    axis_types: "auto" (default) or "explicit", applied to every axis.
    devices_per_host: defaults to the devices of one process (one process per host).
    """
    devices = list(jax.devices() if devices is None else devices)
    n_proc = len({d.process_index for d in devices})
    if devices_per_host is None:
        devices_per_host = len(devices) // n_proc
    spec = resolve_mesh_spec(spec, len(devices), devices_per_host)
    kinds = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
    if axis_types not in kinds:
        raise ValueError(f"axis_types must be 'auto' or 'explicit', got {axis_types!r}")
    arr = device_array(spec, devices, devices_per_host)
    return Mesh(arr, spec.names, axis_types=(kinds[axis_types],) * len(spec.axes))


def mesh_tiers(spec: MeshSpec | str) -> dict[str, str]:
    """{axis name: tier} for a spec or flag string."""
    if isinstance(spec, str):
        spec = parse_mesh_spec(spec)
    return {a.name: a.tier for a in spec.axes}
