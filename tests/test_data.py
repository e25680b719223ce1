"""luxnn.data.DataLoader: batching, shuffling, structures, devices and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from luxnn.data import DataLoader


def samples(n: int = 10) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(n * 2, dtype=np.float32).reshape(n, 2), np.arange(n)


def test_single_array_batches_in_order():
    x, _ = samples()
    loader = DataLoader(x, batch_size=4)
    batches = list(loader)
    assert len(loader) == len(batches) == 3
    assert [b.shape for b in batches] == [(4, 2), (4, 2), (2, 2)]
    np.testing.assert_array_equal(np.concatenate(batches), x)


def test_unshuffled_batches_are_views():
    x, _ = samples()
    first = next(iter(DataLoader(x, batch_size=4)))
    assert np.shares_memory(first, x)


def test_drop_last():
    x, y = samples()
    loader = DataLoader((x, y), batch_size=4, drop_last=True)
    batches = list(loader)
    assert len(loader) == len(batches) == 2
    assert all(xb.shape == (4, 2) and yb.shape == (4,) for xb, yb in batches)


def test_batch_size_dividing_evenly_or_exceeding_the_data():
    x, _ = samples(8)
    assert len(DataLoader(x, batch_size=4)) == 2
    assert len(DataLoader(x, batch_size=4, drop_last=True)) == 2
    assert [b.shape[0] for b in DataLoader(x, batch_size=100)] == [8]


def test_tuple_batches_keep_pairs_together_when_shuffled():
    x, y = samples()
    loader = DataLoader((x, y), batch_size=3, shuffle=True, rng=np.random.default_rng(0))
    for xb, yb in loader:
        np.testing.assert_array_equal(xb, x[yb])


def test_dict_and_nested_structures():
    x, y = samples()
    loader = DataLoader({"image": x, "labels": {"class": y}}, batch_size=5)
    batch = next(iter(loader))
    assert set(batch) == {"image", "labels"} and set(batch["labels"]) == {"class"}
    np.testing.assert_array_equal(batch["labels"]["class"], y[:5])


def test_every_sample_seen_once_per_epoch_and_reshuffled():
    _, y = samples(20)
    loader = DataLoader(y, batch_size=6, shuffle=True, rng=np.random.default_rng(3))
    epochs = [np.concatenate(list(loader)) for _ in range(3)]
    for order in epochs:
        np.testing.assert_array_equal(np.sort(order), y)
    assert not np.array_equal(epochs[0], epochs[1])


def test_shuffle_is_deterministic_with_a_seeded_rng():
    _, y = samples(20)

    def two_epochs(seed: int) -> list[np.ndarray]:
        loader = DataLoader(y, batch_size=6, shuffle=True, rng=np.random.default_rng(seed))
        return [b for _ in range(2) for b in loader]

    for a, b in zip(two_epochs(7), two_epochs(7)):
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(a, b) for a, b in zip(two_epochs(7), two_epochs(8)))


def test_shuffle_with_drop_last_yields_full_batches_of_distinct_samples():
    _, y = samples(10)
    loader = DataLoader(y, batch_size=4, shuffle=True, drop_last=True, rng=np.random.default_rng(0))
    seen = np.concatenate(list(loader))
    assert seen.shape == (8,) and len(np.unique(seen)) == 8


def test_device_is_applied_to_every_batch():
    x, y = samples()
    moved = []

    def device(batch):
        moved.append(batch)
        return ("on device", batch)

    loader = DataLoader((x, y), batch_size=4, device=device)
    out = list(loader)
    assert len(moved) == 3 and all(tag == "on device" for tag, _ in out)
    assert isinstance(moved[0], tuple) and len(moved[0]) == 2


@pytest.mark.parametrize("data, kwargs, fragment", [
    ((np.zeros((3, 2)), np.zeros(4)), {}, "same leading length, got '0': 3, '1': 4"),
    ({"x": np.zeros(3), "y": np.zeros(5)}, {}, "'x': 3, 'y': 5"),
    (np.zeros(3), {"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    (np.zeros(3), {"batch_size": 1.5}, "batch_size must be an integer >= 1, got 1.5"),
    (np.zeros(3), {"batch_size": True}, "batch_size must be an integer >= 1"),
    (np.zeros((0, 2)), {}, "at least one sample, got arrays of leading length 0"),
    ((), {}, "expected an array or a tuple/dict of arrays, got an empty tuple"),
    ({}, {}, "got an empty dict"),
    (np.float32(1.0), {}, "leading sample axis, got a 0-d array"),
    ([1, 2, 3], {}, "data '0' must be an array, got int"),
    (np.zeros(3), {"batch_size": 4, "drop_last": True}, "would yield no batch"),
    (np.zeros(3), {"rng": 0}, "rng must be a numpy.random.Generator, got int"),
    (np.zeros(3), {"device": "cpu"}, "device must be callable"),
])
def test_bad_input_raises_saying_what_was_expected(data, kwargs, fragment):
    kwargs = {"batch_size": 2, **kwargs}
    with pytest.raises(ValueError) as info:
        DataLoader(data, **kwargs)
    assert fragment in str(info.value)
