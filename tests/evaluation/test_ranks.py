"""The launcher's RANK, LOCAL_RANK and WORLD_SIZE are checked before any rendezvous (a rank outside the world waits for ever)."""

from __future__ import annotations

import pytest

from eogym_sft.evaluation import ranks


@pytest.mark.parametrize(
    "env,message",
    [
        ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK='5' must be a whole number from 0 to 1"),
        ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK='-1' must be a whole number from 0 to 1"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "2"}, "LOCAL_RANK='2' must be a whole number from 0 to 1"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' must be a whole number >= 1"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be a whole number >= 1"),
        ({"RANK": "1"}, "RANK='1' must be a whole number from 0 to 0"),
    ],
)
def test_join_refuses_a_rank_outside_the_world_before_the_rendezvous(monkeypatch, env, message):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as err:
        ranks.join()
    assert str(err.value) == f"the environment variable {message}"


def test_one_process_needs_no_group(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert ranks.join() == ranks.Group()
    assert ranks.placement() == (0, 1, 0)
