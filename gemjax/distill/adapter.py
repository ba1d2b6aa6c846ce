"""The Student Adapter: a per-task calibration of the teacher's logit, fitted only on
the most recent labeled window and refitted as labels arrive.

For task k, with the teacher logit z [B] and optional per-sample features f [B, F]
(cheap inputs the drift changes the response to; the Distiller's adapter_kind
"features" passes the sample's dense inputs and / or the teacher's sequence
embedding), the corrected soft-target logit is

    a_k * z + b_k + w_k . f

(Platt scaling, plus a linear term in f: it can re-weigh what the teacher ranks
by, where the affine part only rescales the teacher's logit). The coefficients
start at the identity (a = 1, b = 0, w = 0) and are refitted every `refresh_every`
observed batches by Newton's method on the L2-penalised log loss of the rows in the
window: the newest `window` observed rows whose task-k label is present
(label_mask * weight > 0).
`correct` uses the coefficients of the last fit, so a batch's own labels (observed
after it is corrected) and every later label never reach the soft labels of earlier
batches. Host-side numpy, float64.
"""

from __future__ import annotations

import collections

import numpy as np


def _finite(name: str, x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    if not np.all(np.isfinite(x)):
        bad = np.argwhere(~np.isfinite(x))[0].tolist()
        raise ValueError(f"StudentAdapter: {name} holds {int(np.sum(~np.isfinite(x)))} non-finite "
                         f"values (first at index {bad})")
    return x


def fit_platt(z: np.ndarray, y: np.ndarray, w: np.ndarray, f: np.ndarray | None = None, *,
              l2: float = 1e-3, iters: int = 20) -> np.ndarray:
    """Coefficients [2 + F] (a, b, w...) of the weighted logistic regression of y on
    [z, 1, f], L2 penalty l2 * |coef - (1, 0, 0...)|^2 (shrinks toward the identity),
    by Newton's method. z, y, w [N]; f [N, F] or None."""
    x = np.column_stack([z, np.ones_like(z)] + ([f] if f is not None and f.shape[1] else []))
    prior = np.zeros(x.shape[1])
    prior[0] = 1.0
    coef = prior.copy()
    n = max(float(np.sum(w)), 1.0)
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-np.clip(x @ coef, -30, 30)))
        grad = x.T @ (w * (p - y)) / n + 2 * l2 * (coef - prior)
        hess = (x * (w * p * (1 - p))[:, None]).T @ x / n + 2 * l2 * np.eye(x.shape[1])
        step = np.linalg.solve(hess, grad)
        coef = coef - step
        if np.max(np.abs(step)) < 1e-10:
            break
    return coef


class StudentAdapter:
    """Per-task calibration of teacher logits on the newest labeled window (module docstring).

    num_tasks K; window: labeled rows per task kept for the fit; refresh_every: observed
    batches between refits; num_features F of the optional student-side features.
    """

    def __init__(self, num_tasks: int, window: int = 4096, refresh_every: int = 1,
                 num_features: int = 0, l2: float = 1e-3):
        if window < 1 or refresh_every < 1 or num_tasks < 1 or num_features < 0:
            raise ValueError(f"StudentAdapter: num_tasks ({num_tasks}), window ({window}) and "
                             f"refresh_every ({refresh_every}) must be >= 1, num_features "
                             f"({num_features}) >= 0")
        self.num_tasks, self.window, self.refresh_every = num_tasks, window, refresh_every
        self.num_features, self.l2 = num_features, l2
        self.coef = np.zeros((num_tasks, 2 + num_features))
        self.coef[:, 0] = 1.0
        # per task: deque of (z [n], y [n], w [n], f [n, F]) chunks, newest last
        self._rows = [collections.deque() for _ in range(num_tasks)]
        self._count = [0] * num_tasks
        self.observed = 0        # batches observed
        self.fits = 0            # refits done

    def _features(self, features, b: int) -> np.ndarray:
        if self.num_features == 0:
            return np.zeros((b, 0))
        if features is None or np.shape(features) != (b, self.num_features):
            raise ValueError(f"StudentAdapter: features must be [{b}, {self.num_features}], got "
                             f"{None if features is None else np.shape(features)}")
        return _finite("features", features)

    def correct(self, teacher_logits, features=None) -> np.ndarray:
        """Corrected soft-target logits [B, K] (float32) from teacher logits [B, K]."""
        z = _finite("teacher_logits", teacher_logits)
        if z.ndim != 2 or z.shape[1] != self.num_tasks:
            raise ValueError(f"StudentAdapter: teacher_logits must be [B, {self.num_tasks}], got "
                             f"{z.shape}")
        f = self._features(features, z.shape[0])
        out = z * self.coef[:, 0] + self.coef[:, 1] + f @ self.coef[:, 2:].T
        return out.astype(np.float32)

    def observe(self, teacher_logits, labels, label_mask, weights, features=None) -> bool:
        """Add a batch's labeled rows (teacher logits, labels, label_mask [B, K],
        weights [B]) to the window; refit when due. Returns whether it refitted."""
        z = _finite("teacher_logits", teacher_logits)
        y = _finite("labels", labels)
        m = _finite("label_mask", label_mask) * _finite("weights", weights)[:, None]
        f = self._features(features, z.shape[0])
        for k in range(self.num_tasks):
            keep = m[:, k] > 0
            if np.any(keep):
                self._rows[k].append((z[keep, k], y[keep, k], m[keep, k], f[keep]))
                self._count[k] += int(np.sum(keep))
            while self._rows[k] and self._count[k] - len(self._rows[k][0][0]) >= self.window:
                self._count[k] -= len(self._rows[k].popleft()[0])
        self.observed += 1
        if self.observed % self.refresh_every:
            return False
        self.refit()
        return True

    def window_rows(self, k: int):
        """(z, y, w, f) of the newest `window` labeled rows of task k."""
        if not self._rows[k]:
            return np.zeros(0), np.zeros(0), np.zeros(0), np.zeros((0, self.num_features))
        z, y, w, f = (np.concatenate(c)[-self.window:] for c in zip(*self._rows[k]))
        return z, y, w, f

    def state_arrays(self) -> dict[str, np.ndarray]:
        """What the next corrections depend on, as arrays: coef [K, 2 + F], per task k its
        window rows z{k}, y{k}, w{k} [n], f{k} [n, F] (n <= window), observed, fits []."""
        out = {"coef": self.coef.copy(), "observed": np.asarray(self.observed),
               "fits": np.asarray(self.fits)}
        for k in range(self.num_tasks):
            out.update({f"{n}{k}": x for n, x in zip("zywf", self.window_rows(k))})
        return out

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Take the state `state_arrays` gave (of an adapter of the same shape)."""
        if np.shape(arrays["coef"]) != self.coef.shape:
            raise ValueError(f"StudentAdapter: saved coef {np.shape(arrays['coef'])}, this adapter "
                             f"{self.coef.shape}")
        self.coef = np.array(arrays["coef"], np.float64)
        self.observed, self.fits = int(arrays["observed"]), int(arrays["fits"])
        for k in range(self.num_tasks):
            rows = tuple(np.asarray(arrays[f"{n}{k}"]) for n in "zywf")
            self._rows[k] = collections.deque([rows] if len(rows[0]) else [])
            self._count[k] = len(rows[0])

    def refit(self) -> None:
        """Fit every task's coefficients on its window (tasks without rows keep theirs)."""
        for k in range(self.num_tasks):
            z, y, w, f = self.window_rows(k)
            if len(z):
                self.coef[k] = fit_platt(z, y, w, f, l2=self.l2)
        self.fits += 1
