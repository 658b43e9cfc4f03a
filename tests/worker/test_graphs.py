from chatq.worker.graphs import buckets


def test_buckets_cover_every_batch_size_with_at_most_seven_padding_rows():
    sizes = buckets(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256
    for n in range(1, 257):
        assert min(s for s in sizes if s >= n) - n < 8
    assert buckets(4) == [1, 2, 4]
    assert buckets(100)[-2:] == [96, 100]
