import pytest
import torch

import dcp_compile as dcp


def test_no_torchrun_environment_gives_a_group_of_one():
    group = dcp.init_group("cpu")
    assert (group.size, group.rank, group.process_group) == (1, 0, None)
    assert group.device == torch.device("cpu")
    with pytest.raises(ValueError, match="size 1 has no process group"):
        group.group_name


def test_world_size_one_needs_no_process_group(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert dcp.init_group("cpu").size == 1


def test_incomplete_torchrun_environment_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"incomplete torchrun environment: .* \['MASTER_ADDR', 'MASTER_PORT'\] are not"):
        dcp.init_group("cpu")
