"""Blockwise seeded random Hadamard transform along the last axis.

For x [..., n] with n a multiple of `block` (a power of two), each block of `block`
consecutive elements is multiplied by random signs d (one per position of the whole axis,
drawn from `key`) and then by the orthonormal Sylvester Hadamard matrix
H (block x block, H = H^T, H H^T = I, entries +-1/sqrt(block)):

    transform(x)[..., blk] = (x[..., blk] * d[blk]) @ H
    inverse(y)[..., blk]   = (y[..., blk] @ H) * d[blk]

It spreads an outlier over its block before quantization; since the transform is
orthogonal, applying it to both operands along a contraction axis leaves a product
unchanged. Computed in float32 with log2(block) butterfly stages (no matmul), the result
in the dtype of x.
"""

import jax
import jax.numpy as jnp


def hadamard_signs(key: jax.Array, n: int) -> jax.Array:
    """The random signs d of `key` for an axis of length n: float32 [n] of +-1."""
    return jax.random.rademacher(key, (n,), dtype=jnp.float32)


def _check(x: jax.Array, block: int) -> None:
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    if x.ndim == 0 or x.shape[-1] % block:
        raise ValueError(f"x of shape {x.shape}: the last axis must be a multiple of "
                         f"block={block}")


def _hadamard_blocks(x: jax.Array, block: int) -> jax.Array:
    """x [..., n] float32 -> each block of the last axis times H (orthonormal)."""
    lead, n = x.shape[:-1], x.shape[-1]
    h = 1
    while h < block:
        pairs = x.reshape(lead + (n // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2).reshape(lead + (n,))
        h *= 2
    return x * jnp.float32(block ** -0.5)


def random_hadamard(x: jax.Array, key: jax.Array, block: int = 128) -> jax.Array:
    """The seeded random Hadamard transform of x [..., n] (n % block == 0) -> [..., n]."""
    x = jnp.asarray(x)
    _check(x, block)
    d = hadamard_signs(key, x.shape[-1])
    return _hadamard_blocks(x.astype(jnp.float32) * d, block).astype(x.dtype)


def inverse_random_hadamard(y: jax.Array, key: jax.Array, block: int = 128) -> jax.Array:
    """The inverse of `random_hadamard` with the same key and block: [..., n] -> [..., n]."""
    y = jnp.asarray(y)
    _check(y, block)
    d = hadamard_signs(key, y.shape[-1])
    return (_hadamard_blocks(y.astype(jnp.float32), block) * d).astype(y.dtype)
