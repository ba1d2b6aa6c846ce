"""Reserved for knowledge transfer from the GEM teacher to smaller served models.

It holds no code yet: a run trains one model (`model.kind`: lr, gem or teacher) on the
data's own labels; gemjax.serve loads, evaluates and exports it.
"""
