"""Using a trained run: eval-only, prediction and export for serving.

    from gemjax.serve.restore import read_config, restore     # a run's Config and state
    from gemjax.serve.evaluate import evaluate_checkpoint      # train.py --mode=eval
    from gemjax.serve.inference import load_for_inference     # predict(Batch) -> [B, K]
    from gemjax.serve.export import export_model, load_exported   # jax.export for serving
    from gemjax.serve.admitted import map_batch, export_admitted  # raw ids of an online model

Everything reads a finished (or running) run's WORKDIR: config.json for the
Config and the Orbax checkpoints under WORKDIR/best (the model selection's best
step, read by default when the run has it) or WORKDIR/checkpoints (the newest),
which hold the tables in logical row order and restore onto any mesh.
"""
