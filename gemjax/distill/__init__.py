"""Knowledge transfer from the GEM teacher to smaller served models.

losses (KD objective, representation-matching loss), adapter (the Student Adapter),
batch (DistillBatch: a Batch carrying the teacher's outputs), represent (teacher
features), transfer (DistillConfig, Teacher, Distiller, refresh_student), runs (a
student trained, resumed, evaluated and exported as a train() run). Students are
gemjax.models.student (model.kind="student"); experiments/distill.py compares the
methods.
"""
