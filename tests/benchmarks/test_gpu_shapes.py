"""benchmarks/gpu_shapes.py runs where a GPU is lent, rarely: its CPU dry run keeps it working."""

from benchmarks import gpu_shapes


def test_the_dry_run_compares_every_stack_and_both_caches(tmp_path):
    report = gpu_shapes.main(["--small", "--lengths", "256", "--resident", "1", "--new-tokens", "6",
                              "--dtype", "float32", "--out", str(tmp_path / "shapes.json")])
    on_chip, offloaded = report["rows"]
    assert (on_chip["offload"], offloaded["offload"]) == (False, True)
    for row in (on_chip, offloaded):
        assert "error" not in row, row
        assert set(row["stacks"]) == set(gpu_shapes.STACKS)
        # float32 on one device: every stack gives plain decoding's greedy tokens
        assert all(s["first_difference_from_plain"] is None for s in row["stacks"].values())
    assert offloaded["plain_first_difference_from_other_cache"] is None
    assert offloaded["stacks"]["plain"]["kv_host_memory"] == "pageable"  # the CPU stand-in's host copy
    assert len(on_chip["plain_tokens"]) == 6
