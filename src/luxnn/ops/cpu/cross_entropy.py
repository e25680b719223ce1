"""The fused cross-entropies on the CPU (NumPy arrays): the labels checked on the host,
then one pass forward. Each function returns ``(out, vjp)`` as the primitives of
`luxnn.ops.cross_entropy` do."""

from __future__ import annotations

import numpy as np

__all__ = ["softmax_cross_entropy", "nll_loss"]

# The message of a mean over no counted target, on every device.
NO_COUNT = ("{owner}: no target counts towards the mean (every label ignored or of weight 0); use reduction='sum' "
            "for a batch that may have none")


def _check_labels(labels, k, ignore_index, owner):
    """Raises unless every label is in ``[0, k)`` or `ignore_index`."""
    real = labels if ignore_index is None else labels[labels != ignore_index]
    if real.size and (int(real.min()) < 0 or int(real.max()) >= k):
        raise ValueError(f"{owner}: labels must lie in [0, {k}), got values in [{int(real.min())}, {int(real.max())}]")


def softmax_cross_entropy(logits, labels, label_smoothing, reduction, weight, ignore_index, owner):
    """Per-example ``-log softmax(logits)[label]`` (smoothed, weighted, ignoring
    `ignore_index`), reduced by `reduction`."""
    k = logits.shape[-1]
    _check_labels(labels, k, ignore_index, owner)
    shifted = logits - np.max(logits, axis=-1, keepdims=True)
    e = np.exp(shifted)
    total = np.sum(e, axis=-1, keepdims=True)
    lse = np.log(total).reshape(-1)
    flat_shifted = shifted.reshape(-1, k)
    # The labels' entries of the (rows, K) view: plain fancy indexing, which is several
    # times cheaper than take_along_axis on small batches.
    rows = np.arange(labels.size)
    flat_labels = labels.reshape(-1)
    keep = None
    if ignore_index is not None:
        keep = flat_labels != ignore_index
        flat_labels = np.where(keep, flat_labels, 0)
    if weight is not None:
        weight = np.asarray(weight, dtype=logits.dtype)
        label_weight = weight[flat_labels]
    loss = lse - flat_shifted[rows, flat_labels]
    if weight is not None:
        loss *= label_weight
    if label_smoothing:
        # sum over the classes c of w_c * -log softmax_c (w_c = 1 without weights)
        smooth = k * lse - flat_shifted.sum(axis=-1) if weight is None else weight.sum() * lse - flat_shifted @ weight
        loss = (1 - label_smoothing) * loss + (label_smoothing / k) * smooth
    if keep is not None:
        loss *= keep

    if reduction == "mean":
        if weight is not None:
            count = (label_weight * keep).sum() if keep is not None else label_weight.sum()
        else:
            count = keep.sum() if keep is not None else labels.size
        if not count > 0:
            raise ValueError(NO_COUNT.format(owner=owner))

    def vjp(g, needs):
        grad = e / total  # the softmax
        flat = grad.reshape(-1, k)
        if weight is None:
            flat[rows, flat_labels] -= 1 - label_smoothing
            if label_smoothing:
                grad -= label_smoothing / k
        else:
            # d/dz of (1-s) w_y (lse - z_y) + (s/K) sum_c w_c (lse - z_c)
            flat *= ((1 - label_smoothing) * label_weight + (label_smoothing / k) * weight.sum())[:, None]
            flat[rows, flat_labels] -= (1 - label_smoothing) * label_weight
            if label_smoothing:
                flat -= (label_smoothing / k) * weight
        if keep is not None:
            flat *= keep[:, None]
        if reduction == "none":
            grad *= g[..., None]
        else:
            grad *= g / count if reduction == "mean" else g
        return grad, None

    if reduction == "none":
        return loss.reshape(labels.shape), vjp
    total_loss = loss.sum()
    return (total_loss / count if reduction == "mean" else total_loss), vjp


def nll_loss(log_probs, labels, reduction, weight, ignore_index, owner):
    """Per-example ``-weight[label] * log_probs[label]`` (0 for `ignore_index`), reduced by
    `reduction` ("mean": over the weights of the examples not ignored)."""
    k = log_probs.shape[-1]
    _check_labels(labels, k, ignore_index, owner)
    keep = None if ignore_index is None else labels != ignore_index
    picked = labels if keep is None else np.where(keep, labels, 0)
    example_weight = None if weight is None else np.asarray(weight, dtype=log_probs.dtype)[picked]
    if keep is not None:
        example_weight = keep.astype(log_probs.dtype) if example_weight is None else example_weight * keep
    flat = np.arange(labels.size) * k + picked.reshape(-1)
    losses = -np.take(log_probs.reshape(-1), flat).reshape(labels.shape)
    if example_weight is not None:
        losses = losses * example_weight
    count = None
    if reduction == "none":
        out = losses
    elif reduction == "sum":
        out = losses.sum()
    else:
        count = labels.size if example_weight is None else float(example_weight.sum())
        if not count > 0:
            raise ValueError(NO_COUNT.format(owner=owner))
        out = losses.sum() / count

    def vjp(g, needs):
        if count is not None:
            g = g / count
        g = np.broadcast_to(g, labels.shape)
        if example_weight is not None:
            g = g * example_weight
        grad = np.zeros(log_probs.shape, log_probs.dtype)
        np.add.at(grad.reshape(-1), flat, -g.reshape(-1))
        return grad, None

    return out, vjp
