"""The named presets (gemjax.presets) and overrides at any depth (gemjax.config.replace_path).

The real-data presets carry the schema their converter writes, checked against the
converters' own schema functions at the real datasets' sizes; a synthetic preset's
schema follows its data fields. Overrides reach fields of nested dataclasses and tuple
entries (by name or index), checked against objects built by hand.
"""

import dataclasses

import pytest

from experiments import convert_frappe, convert_movielens
from gemjax import presets
from gemjax.config import PRESETS, apply_overrides, get_config, replace_path, schema_of


def ml1m_schema(max_history: int):
    """convert_movielens' schema at MovieLens-1M's sizes (6,040 users, 3,952 items + padding row)."""
    return convert_movielens.movielens_schema(6_040, {"gender": 2, "age": 7, "occupation": 21},
                                              3_953, 18, max_history)


def test_the_presets_fill_the_config_registry():
    assert presets.PRESETS is PRESETS
    assert {"tiny", "small", "gem1b", "frappe", "movielens_retrieval", "movielens_hstu_large"} <= set(PRESETS)
    assert all(cfg.name == name for name, cfg in PRESETS.items())


def test_real_data_presets_carry_their_converters_schema():
    real = {n for n, c in PRESETS.items() if c.data.source == "parquet"}
    assert real == {"frappe", "movielens_retrieval", "movielens_hstu_large", "movielens_hstu_large_rab"}
    assert get_config("frappe").features == convert_frappe.frappe_schema(5_382, 10)
    for name in real - {"frappe"}:
        assert get_config(name).features == ml1m_schema(200), name


def test_synthetic_presets_follow_their_data_fields():
    for name, cfg in PRESETS.items():
        if cfg.data.source == "synthetic":
            assert cfg.features is None, name
    f = schema_of(get_config("tiny", "data.vocab_item=999,data.num_dense=3,data.seq_cap=16"))
    assert f.table("item").vocab == 999 and f.dense == ("dense0", "dense1", "dense2")
    assert {s.max_len for s in f.sequences} == {16}


def test_overrides_reach_the_schema_of_a_real_data_preset():
    cfg = get_config("movielens_retrieval", "features.sequences.history.max_len=50")
    assert cfg.features == ml1m_schema(50)
    cfg = apply_overrides(cfg, "features.tables.4.dim=32,features.tables.genre.bounds=clamp")
    assert [(t.name, t.dim, t.bounds) for t in cfg.features.tables][4:] == [
        ("item", 32, "strict"), ("genre", None, "clamp")]
    with pytest.raises(ValueError, match="features.tables has no entry 'movies'"):
        apply_overrides(cfg, "features.tables.movies.vocab=10")
    with pytest.raises(ValueError, match="'item': vocab must be >= 1"):
        apply_overrides(cfg, "features.tables.item.vocab=0")
    with pytest.raises(ValueError, match="config 'tiny' has no explicit features"):
        get_config("tiny", "features.tables.item.vocab=10")


@dataclasses.dataclass(frozen=True)
class Leaf:
    name: str
    size: int = 1
    widths: tuple[int, ...] = (4,)


@dataclasses.dataclass(frozen=True)
class Branch:
    leaves: tuple[Leaf, ...] = (Leaf("a"), Leaf("b"))
    scale: float | None = None


@dataclasses.dataclass(frozen=True)
class Root:
    branch: Branch = Branch()
    tag: str = "x"


def test_replace_path_at_any_depth():
    root = Root()
    got = replace_path(root, "branch.leaves.b.size", "7")
    assert got == Root(Branch((Leaf("a"), Leaf("b", 7))))
    got = replace_path(got, "branch.leaves.0.widths.0", "9")
    assert got == Root(Branch((Leaf("a", 1, (9,)), Leaf("b", 7))))
    assert replace_path(root, "branch.scale", "0.5") == Root(Branch(scale=0.5))
    assert replace_path(root, "tag", "y") == Root(tag="y")
    assert root == Root()                                   # frozen: the original stays
    for path, message in [("branch.leaves.c.size", "branch.leaves has no entry 'c'"),
                          ("branch.leaf.size", "branch has no field 'leaf'; known: leaves, scale"),
                          ("tag.more", "tag is 'x', which has no fields"),
                          ("branch.scale.more", "branch.scale is None, which has no fields"),
                          ("branch.leaves.a.size", "branch.leaves.a.size='many': not a valid int")]:
        with pytest.raises(ValueError, match=message):
            replace_path(root, path, "many")
