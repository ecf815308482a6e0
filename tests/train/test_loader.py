"""The distributed loader's order and position."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kubellm.data.artifact import load_split
from kubellm.data.prepare import DataError
from kubellm.train.loader import DistributedLoader
from kubellm.train.shards import ShardRows, open_split


def _loader(data: torch.Tensor, rank: int, world: int, micro: int = 2) -> DistributedLoader:
    return DistributedLoader(
        data, global_batch=8, micro_batch=micro, rank=rank, world_size=world, seed=5
    )


@pytest.fixture
def rows() -> torch.Tensor:
    ids = torch.arange(40 * 4, dtype=torch.int32).reshape(40, 4)
    return torch.stack([ids, ids])


def _global_batch(loaders: list[DistributedLoader]) -> list[int]:
    out: list[int] = []
    for loader in loaders:
        for x, _ in loader.next_batch():
            out += (x[:, 0] // 4).tolist()
    return out


def test_ranks_split_one_global_batch_and_any_world_size_sees_the_same_order(rows) -> None:
    two = [_loader(rows, r, 2) for r in range(2)]
    four = [_loader(rows, r, 4) for r in range(4)]
    one = [_loader(rows, 0, 1, micro=8)]
    epoch: list[int] = []
    for _ in range(5):  # 40 rows / 8 = one epoch
        batch = _global_batch(two)
        assert len(set(batch)) == 8
        assert batch == _global_batch(four) == _global_batch(one)
        epoch += batch
    assert sorted(epoch) == list(range(40))
    assert _global_batch(two) != epoch[:8]  # the next epoch is a new permutation


def test_position_round_trips_and_a_different_dataset_is_refused(rows) -> None:
    a = _loader(rows, 1, 2)
    for _ in range(3):
        a.next_batch()
    b = _loader(rows, 1, 2)
    b.load_state_dict(a.state_dict())
    assert [x.tolist() for x, _ in a.next_batch()] == [x.tolist() for x, _ in b.next_batch()]
    other = _loader(rows[:, :32], 1, 2)
    with pytest.raises(DataError, match="40 sequences, global batch 8, seed 5; this run has 32"):
        other.load_state_dict(a.state_dict())


def test_micro_batches_are_long_tensors_with_masked_labels(tiny_dataset: Path) -> None:
    data = load_split(tiny_dataset, "train")
    assert data.dtype == torch.int32  # 4 bytes per token held
    loader = DistributedLoader(data, global_batch=8, micro_batch=4, rank=0, world_size=1, seed=0)
    (x, y), (x2, _) = loader.next_batch()
    assert x.dtype == torch.long and x.shape == (4, 16) and x2.shape == (4, 16)
    assert (y == -100).any() and torch.equal(y[y != -100], x[y != -100])


def test_too_small_a_dataset_fails_early(rows) -> None:
    with pytest.raises(DataError, match="fewer than one batch of 64"):
        DistributedLoader(rows, global_batch=64, micro_batch=32, rank=0, world_size=2, seed=0)


def _batches(loader: DistributedLoader, steps: int) -> list[list[list[list[int]]]]:
    return [[x.tolist() + y.tolist() for x, y in loader.next_batch()] for _ in range(steps)]


def test_shard_rows_and_prefetch_give_the_same_batches_across_a_round_trip(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    def make(data: ShardRows | torch.Tensor, prefetch: bool) -> DistributedLoader:
        return DistributedLoader(
            data,
            global_batch=8,
            micro_batch=2,
            rank=1,
            world_size=2,
            seed=7,
            prefetch=prefetch,
        )

    in_memory = make(load_split(tiny_dataset, "train"), prefetch=False)
    mapped = open_split(tiny_dataset, "train", tmp_path)
    ahead = make(mapped, prefetch=True)
    expected = _batches(in_memory, 6)
    assert _batches(ahead, 3) == expected[:3]
    assert ahead._ahead is not None and ahead._ahead[0] == 3  # step 3 is being gathered
    saved = ahead.state_dict()
    assert saved == {"step": 3, "num_sequences": mapped.num_sequences, "global_batch": 8, "seed": 7}
    assert _batches(ahead, 2) == expected[3:5]  # step 5 is being gathered now
    ahead.load_state_dict(saved)  # back to step 3: the prefetched step 5 is dropped
    assert _batches(ahead, 3) == expected[3:6]
    fresh = make(mapped, prefetch=True)
    fresh.next_batch()  # prefetches step 1, then jumps to step 3
    fresh.load_state_dict(saved)
    assert _batches(fresh, 3) == expected[3:6]
    with pytest.raises(DataError, match="this run has 40"):
        make(torch.zeros(2, 40, 16, dtype=torch.int32), prefetch=True).load_state_dict(saved)
    ahead.close()
    assert _batches(ahead, 1) == _batches(make(mapped, prefetch=False), 7)[-1:]


def test_batches_are_put_on_the_loader_device(rows) -> None:
    loader = DistributedLoader(
        rows, global_batch=8, micro_batch=2, rank=0, world_size=2, seed=5, device="meta"
    )
    micro = loader.next_batch()
    assert len(micro) == 2
    for x, y in micro:
        assert x.device.type == y.device.type == "meta"
        assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (2, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_come_through_pinned_memory_in_one_copy(tiny_dataset, tmp_path) -> None:
    mapped = open_split(tiny_dataset, "train", tmp_path)
    cpu = DistributedLoader(mapped, global_batch=8, micro_batch=2, rank=0, world_size=1, seed=1)
    gpu = DistributedLoader(
        mapped, global_batch=8, micro_batch=2, rank=0, world_size=1, seed=1, device="cuda"
    )
    assert gpu.device == torch.device("cuda", torch.cuda.current_device())
    assert gpu._gather(0).is_pinned()
    for _ in range(4):
        for (x, y), (cx, cy) in zip(gpu.next_batch(), cpu.next_batch(), strict=True):
            assert x.is_cuda and x.dtype == torch.long
            assert torch.equal(x.cpu(), cx) and torch.equal(y.cpu(), cy)
    assert gpu._ahead is not None and gpu._ahead[1].result().is_pinned()
    gpu.close()
