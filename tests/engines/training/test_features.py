"""Where a training run's target features come from: stored shards or on the fly, chosen per run."""

from __future__ import annotations

import pytest
import torch

from engines.training.data import Example, ShardWriter
from engines.training.features import OnTheFlyFeatures, StoredFeatures, choose_features


def test_auto_stores_when_epochs_reuse_features_and_streams_when_disk_is_short(tmp_path):
    common = {"hidden_size": 576, "folder": tmp_path, "feature_rate": 2000.0, "train_rate": 2000.0}
    assert choose_features("auto", 10_000, epochs=3, workers=1, **common).mode == "store"
    # One epoch over 4 workers: each worker's own target pass beats one process writing every shard.
    plan = choose_features("auto", 10_000, epochs=1, workers=4, **common)
    assert plan.mode == "on-the-fly" and plan.estimate_s["on-the-fly"] < plan.estimate_s["store"]
    huge = choose_features("auto", 10**15, epochs=3, workers=1, **common)
    assert huge.mode == "on-the-fly" and "GB" in huge.reason
    assert choose_features("store", 10**15, epochs=1, workers=1, **common).mode == "store"  # as set
    with pytest.raises(ValueError, match="features must be"):
        choose_features("disk", 10, epochs=1, workers=1, **common)


def test_stored_and_on_the_fly_sources_give_the_same_sequences_in_the_same_order(engine_fp32, tmp_path):
    from engines.training.data import target_hidden_states

    examples = [Example(f"e{i}", list(range(10 + i, 30 + 2 * i)), [0] * 5 + [1] * (15 + i)) for i in range(7)]
    writer = ShardWriter(tmp_path, shard_tokens=50)
    for ex in examples:
        writer.add(ex, target_hidden_states(engine_fp32.model, ex.token_ids))
    writer.flush()
    stored, live = StoredFeatures(tmp_path), OnTheFlyFeatures(engine_fp32.model, examples)
    assert len(stored) == len(live) == 7
    for seed, rank, world, skip in ((None, 0, 1, 0), (3, 1, 2, 1), (3, 0, 2, 0)):
        a = list(stored.sequences(seed, rank, world, skip))
        b = list(live.sequences(seed, rank, world, skip))
        assert len(a) == len(b) == len(range(rank, 7, world)) - skip
        for (ha, ta, ma), (hb, tb, mb) in zip(a, b, strict=True):
            assert torch.equal(ta, tb) and torch.equal(ma, mb)
            torch.testing.assert_close(ha.float(), hb.to(torch.bfloat16).float())
    # Workers' shares are disjoint and cover the epoch.
    ids = [tuple(t.tolist()) for r in (0, 1) for _, t, _ in stored.sequences(5, r, 2)]
    assert sorted(ids) == sorted(tuple(e.token_ids) for e in examples)
