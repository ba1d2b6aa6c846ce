"""The teacher of the distillation tests (tests/test_distill*.py): a GEM v0 teacher
(model.kind=gem, with sequences) whose train step compiles in far less time than
experiments/distill.py's TEACHER, at the same width (model.dim: the students' shared
tables and dense_proj keep their shapes). One sequence layer with one GDPA head, no RoPE
and no query/key norm, one Wukong layer: the distill code reads its logits, its sequence
embedding (repr), its tables and its dense_proj as it reads any gem teacher's.

    TEACHER        experiments/distill.py's TEACHER with these overrides
    CHEAP          the overrides alone (on the tiny preset: test_distill.py's teacher)
"""

CHEAP = ("model.attention=gdpa,model.rope=false,model.qk_norm=false,model.seq_heads=1,"
         "model.seq_layers=1,model.wukong_layers=1")


def _teacher() -> str:
    from experiments import distill
    return f"{distill.TEACHER},{CHEAP}"


TEACHER = _teacher()
