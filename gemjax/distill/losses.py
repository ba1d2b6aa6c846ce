"""Distillation objectives for binary tasks: standard knowledge distillation (KD).

Per sample i and task k, with the student's logit s, the soft-target logit t (the
teacher's, or the Student Adapter's correction of it), the label y, temperature T and
weight alpha:

    hard  = BCE(y, sigmoid(s))
    soft  = T^2 * BCE(sigmoid(t / T), sigmoid(s / T))
    loss  = (1 - alpha) * hard + alpha * soft

BCE(p, q) = -(p log q + (1 - p) log(1 - q)) is the binary cross-entropy of target p
and prediction q. The T^2 factor (Hinton et al.'s convention) keeps the soft term's
gradient at one scale: d soft / d s = T * (sigmoid(s/T) - sigmoid(t/T)), about
(s - t) / 4 for large T whatever T is, so alpha weighs the two terms alike at any
temperature. Both terms are weighted by label_mask * weights,
so the sums normalise like the plain log loss (gemjax.train.step.masked_bce_sums):
a task whose label is unobserved contributes nothing.

`kd_objective(alpha, temperature)` is the student's train step objective
(gemjax.train.step.BinaryTasks with `kd_sums` as its per-task loss): it reads the
DistillBatch's teacher_logits. Its loss_sum is the objective's, so a student's train
rows in metrics.jsonl report that objective; eval NE is always the labels'.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from gemjax.train.step import BinaryTasks


def soft_bce(logits: jax.Array, target_logits: jax.Array) -> jax.Array:
    """BCE(sigmoid(target_logits), sigmoid(logits)) elementwise, float32 (stable form)."""
    return optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32),
                                              jax.nn.sigmoid(target_logits.astype(jnp.float32)))


def kd_loss(logits: jax.Array, labels: jax.Array, target_logits: jax.Array, *, alpha: float,
            temperature: float) -> jax.Array:
    """The KD loss per element (module docstring): logits, labels, target_logits [B, K]."""
    hard = optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32), labels)
    t = float(temperature)
    soft = t * t * soft_bce(logits / t, target_logits / t)
    return (1.0 - alpha) * hard + alpha * soft


def kd_sums(logits: jax.Array, batch, *, alpha: float, temperature: float):
    """Per-task sums over the batch of the KD loss: (loss_sum [K], weight_sum [K],
    positive_sum [K]); logits [B, K], batch a DistillBatch (teacher_logits [B, K])."""
    w = batch.label_mask * batch.weights[:, None]
    loss = kd_loss(logits, batch.labels, batch.teacher_logits, alpha=alpha,
                   temperature=temperature)
    return jnp.sum(loss * w, 0), jnp.sum(w, 0), jnp.sum(batch.labels * w, 0)


def kd_objective(alpha: float, temperature: float) -> BinaryTasks:
    """The KD objective of a student's train step: BinaryTasks whose task_loss is `kd_sums`
    at (alpha, temperature). ValueError for alpha outside [0, 1] or T <= 0."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"distill alpha must be in [0, 1], got {alpha}")
    if not temperature > 0.0:
        raise ValueError(f"distill temperature must be > 0, got {temperature}")
    return BinaryTasks(functools.partial(kd_sums, alpha=float(alpha), temperature=float(temperature)))


def feature_mse(student_features: jax.Array, teacher_features: jax.Array) -> jax.Array:
    """Representation-matching loss per sample: mean over E of (student - teacher)^2,
    [B, E] x [B, E] -> [B] (a student head projecting its own features onto the
    teacher's; the teacher side carries no gradient)."""
    diff = student_features.astype(jnp.float32) - jax.lax.stop_gradient(
        teacher_features.astype(jnp.float32))
    return jnp.mean(diff * diff, axis=-1)
