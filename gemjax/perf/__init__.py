"""Performance accounting: FLOP counts, MFU, Local MFU and the collective cost model.

  mfu.py          counting conventions, analytic / XLA FLOPs, peak table, MFU, timing
  model_flops.py  the teacher's analytic forward FLOPs per block, from its description
                  (gemjax.models.interformer.TeacherArch) and a batch's jagged lengths
  local_mfu.py    each teacher block timed alone on one device (Local MFU)
  topology.py     bytes and time of each collective per step, predicted scaling ratio

Above gemjax.models (it reads the teacher's description), below nothing it imports.
"""
