"""Which files of a DeepSpeed checkpoint each node of a multi-node job publishes."""

from __future__ import annotations

from worker.rank.checkpointing import node_share


def test_each_node_publishes_its_own_ranks_shards_and_node_0_the_shared_files() -> None:
    files = {
        "mp_rank_00_model_states.pt": 10,  # written alike by every node (node-local storage)
        "latest": 1,
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": 5,
        "zero_pp_rank_1_mp_rank_00_optim_states.pt": 5,
        "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt": 5,
        "zero_pp_rank_3_mp_rank_00_model_states.pt": 5,
    }
    assert node_share(files, node_rank=0, ranks_per_node=2) == files
    assert node_share(files, node_rank=1, ranks_per_node=2) == {
        "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt": 5,
        "zero_pp_rank_3_mp_rank_00_model_states.pt": 5,
    }
    assert node_share(files, node_rank=2, ranks_per_node=2) == {}
