"""Per-host leaves (ckptio.PerHost, stateful objects): each host saves and restores its own (issue 34)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hosts import on_hosts
from paths import WORKERS

import ckptio
from ckptio.errors import ManifestError
from ckptio.manifest import formats
from ckptio.manifest.hoststate import decode_state, encode_state
from ckptio.state.perhost import PerHost, take_modulo

WORKER = str(WORKERS / "resume_worker.py")


class Counter:
    """A stateful object of grain's protocol (get_state / set_state)."""

    def __init__(self, at: int = 0) -> None:
        self.at = at

    def get_state(self) -> dict[str, int]:
        return {"at": self.at}

    def set_state(self, state: dict[str, int]) -> None:
        self.at = state["at"]


def test_state_json_round_trips_every_kind_it_holds():
    torch = pytest.importorskip("torch")
    state = {"a": [1, 2.5, None, True, "s", b"\x00\xff"], 3: (np.int64(-7), np.arange(6, dtype=np.uint16).reshape(2, 3)),
             "g": torch.arange(5, dtype=torch.uint8), "big": 2**80, "nan": float("nan")}
    back = decode_state(json.loads(json.dumps(encode_state(state, "x"))), "x")
    assert list(back) == ["a", 3, "g", "big", "nan"]
    assert back["a"] == state["a"] and back["big"] == 2**80 and np.isnan(back["nan"])
    assert type(back[3]) is tuple and type(back[3][0]) is np.int64 and back[3][0] == -7
    assert back[3][1].dtype == np.uint16 and back[3][1].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert isinstance(back["g"], torch.Tensor) and back["g"].tolist() == [0, 1, 2, 3, 4]


def test_a_state_it_cannot_hold_is_refused_by_path_before_anything_is_written(tmp_path):
    with pytest.raises(TypeError, match=r"data/pos/k.*object"):
        ckptio.save(tmp_path, {"data": PerHost({"pos": {"k": object()}})}, step=1)
    with pytest.raises(ValueError, match="data.*over the"):
        ckptio.save(tmp_path, {"data": PerHost({"pos": np.zeros(1 << 19)})}, step=1)
    assert not any(tmp_path.iterdir()) or ckptio.CheckpointManager(tmp_path).all_steps() == []


def test_stateful_leaf_restores_in_place_and_an_older_reader_refuses(tmp_path, monkeypatch):
    it = Counter(5)
    ckptio.save(tmp_path, {"w": np.arange(3), "it": it, "meta": PerHost({"seen": 12})}, step=1).result()
    fresh = Counter()
    out = ckptio.restore(tmp_path, target={"w": None, "it": fresh, "meta": PerHost(None)})
    assert out["it"] is fresh and fresh.at == 5
    assert out["meta"] == PerHost({"seen": 12})
    assert ckptio.restore(tmp_path)["it"] == {"at": 5}  # no target: the state itself
    monkeypatch.setattr(formats, "VERSION", formats.HOST_STATES_VERSION - 1)
    with pytest.raises(ManifestError, match="version 8"):
        ckptio.restore(tmp_path, step=1)


@pytest.mark.parametrize("split", [True, False], ids=["fragments", "host-local"])
def test_each_of_four_hosts_restores_its_own_and_a_host_count_change_needs_the_hook(tmp_path, split):
    from ckptio.restoring import restore_step
    from ckptio.saving.job import start_save
    from ckptio.store import CheckpointStore, StoreOptions

    url = str(tmp_path)

    def store():
        # host-local: every host's record reaches the coordinator whole (one document, no fragments)
        return CheckpointStore(StoreOptions(url, host_local=not split))

    def save(rank, coord):
        rows = ckptio.Sharded((8,), np.dtype("f4"), [((slice(2 * rank, 2 * rank + 2),), np.full(2, rank, "f4"))])
        state = {"w": rows, "loader": Counter(100 + rank), "pos": PerHost({"rank": rank, "epoch": 3})}
        start_save(store(), 7, state, coordinator=coord).result()

    on_hosts(4, save)

    def restore(rank, coord, hook=None):
        target = {"w": None, "loader": PerHost(Counter(), on_resize=hook), "pos": PerHost(None, on_resize=hook)}
        return restore_step(store(), None, target, coordinator=coord)

    outs = on_hosts(4, restore)
    for rank, out in enumerate(outs):
        assert out["loader"].value.at == 100 + rank and out["pos"].value == {"rank": rank, "epoch": 3}
        assert out["w"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match=r"'loader'.*saved by 4 hosts, restored by 2"):
        on_hosts(2, restore)
    outs = on_hosts(3, lambda r, c: restore(r, c, take_modulo))
    assert [o["loader"].value.at for o in outs] == [100, 101, 102]
    outs = on_hosts(6, lambda r, c: restore(r, c, take_modulo))
    assert [o["pos"].value["rank"] for o in outs] == [0, 1, 2, 3, 0, 1]


class Schedule:
    """A stateful object of torch's protocol that is not a data pipeline (an LR scheduler)."""

    def __init__(self, last: int = 0) -> None:
        self.last = last

    def state_dict(self) -> dict[str, int]:
        return {"last": self.last}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.last = state["last"]


class Loader(Schedule):
    """The same, iterable: a data loader, each host's own position."""

    def __iter__(self):
        return iter(range(self.last, 100))


def test_on_another_host_count_a_scheduler_takes_host_0s_state_and_a_loader_is_refused(tmp_path):
    """As DCP treats a Stateful: a non-iterable stateful leaf holds one state on every host, so a
    restore by another number of hosts gives each the state host 0 saved; a data loader's is its own."""
    from ckptio.restoring import restore_step
    from ckptio.saving.job import start_save
    from ckptio.store import CheckpointStore, StoreOptions

    def store():
        return CheckpointStore(StoreOptions(str(tmp_path)))

    on_hosts(2, lambda r, c: start_save(store(), 3, {"sched": Schedule(40 + r), "loader": Loader(10 + r)},
                                        coordinator=c).result())
    outs = on_hosts(3, lambda r, c: restore_step(store(), None, {"sched": Schedule()}, coordinator=c))
    assert [o["sched"].last for o in outs] == [40, 40, 40]
    with pytest.raises(ValueError, match=r"'loader'.*saved by 2 hosts, restored by 3"):
        on_hosts(3, lambda r, c: restore_step(store(), None, {"sched": Schedule(), "loader": Loader()},
                                              coordinator=c))
    outs = on_hosts(2, lambda r, c: restore_step(store(), None, {"sched": Schedule(), "loader": Loader()},
                                                 coordinator=c))
    assert [(o["sched"].last, o["loader"].last) for o in outs] == [(40, 10), (41, 11)]


@pytest.mark.slow
@pytest.mark.parametrize("hosts", [1, 4])
def test_real_loaders_resume_bit_exact_in_new_processes(tmp_path, hosts):
    """torchdata's StatefulDataLoader (2 workers) and grain's MapDataset / IterDataset iterators,
    saved as leaves at step 4 by every process, restored by fresh processes: each host sees
    exactly the batches of the uninterrupted run."""
    pytest.importorskip("torchdata")
    pytest.importorskip("grain")
    from ckptio.bench.readonce import spawn

    root, out = str(tmp_path / "ckpt"), str(tmp_path)
    spawn(WORKER, hosts, ["save", root, out, "9", "4"], 240)
    spawn(WORKER, hosts, ["resume", root, out, "9", "4"], 240)
    for rank in range(hosts):
        ref = json.loads((tmp_path / f"save-{rank}.json").read_text())
        resumed = json.loads((tmp_path / f"resume-{rank}.json").read_text())
        assert len(ref) == 9 and resumed == ref[4:], rank
        if rank:  # every host read its own data
            assert ref[0] != json.loads((tmp_path / "save-0.json").read_text())[0]


def test_a_state_of_only_per_host_values_saves_from_many_hosts(tmp_path):
    """No array at all: the hosts' summaries hold no boxes (a width-0 table)."""
    from ckptio.saving.job import start_save
    from ckptio.store import CheckpointStore, StoreOptions

    on_hosts(2, lambda r, c: start_save(CheckpointStore(StoreOptions(str(tmp_path))), 1,
                                        {"pos": PerHost(r), "step": 1}, coordinator=c).result())
    assert ckptio.restore(tmp_path, target={"pos": PerHost(None, on_resize=take_modulo), "step": 0}) == {
        "pos": PerHost(0), "step": 1}


def test_tools_show_a_per_host_item_and_a_copy_keeps_it(tmp_path, capsys):
    from ckptio.cli import main

    src, dst = tmp_path / "src", tmp_path / "dst"
    ckptio.save(src, {"w": np.arange(4.0), "pos": PerHost({"at": 3})}, step=1).result()
    assert main(["inspect", "--json", str(src)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["items"]["pos"]["per_host"]["hosts"] == 1
    assert main(["cp", str(src), str(dst)]) == 0
    assert ckptio.restore(dst)["pos"] == {"at": 3}


def test_orbax_adapter_saves_a_grain_iterator_per_process_and_restores_it_in_place(tmp_path):
    grain = pytest.importorskip("grain")
    ocp = pytest.importorskip("orbax.checkpoint")
    import jax.numpy as jnp

    import ckptio.orbax

    def fresh():
        return iter(grain.MapDataset.range(40).shuffle(seed=1).batch(2))

    it = fresh()
    seen = [next(it).tolist() for _ in range(3)]
    mngr = ocp.CheckpointManager(tmp_path)
    mngr.save(3, args=ckptio.orbax.Save({"w": jnp.ones(3), "data": it}))
    after = [next(it).tolist() for _ in range(2)]  # the state was taken when the save was made
    mngr.wait_until_finished()
    again = fresh()
    out = mngr.restore(3, args=ckptio.orbax.Restore({"w": None, "data": again}))
    assert out["data"] is again and [next(again).tolist() for _ in range(2)] == after
    assert seen != after
    mngr.close()


@pytest.mark.slow
def test_dcp_per_rank_loaders_each_come_back_to_their_own_rank(tmp_path):
    """Two gloo ranks save their own StatefulDataLoader (2 workers) with dcp.save through ckptio's
    Writer, wrapped in ckptio.dcp.PerRank; fresh processes dcp.load them: each rank goes on with
    its own next batches."""
    pytest.importorskip("torchdata")
    from ckptio.bench.readonce import spawn

    worker = str(WORKERS / "dcp_perrank_worker.py")
    root = str(tmp_path / "ckpt")
    spawn(worker, 2, ["save", root, str(tmp_path)], 240)
    spawn(worker, 2, ["resume", root, str(tmp_path)], 240)
    after = [json.loads((tmp_path / f"save-{r}.json").read_text()) for r in range(2)]
    assert [json.loads((tmp_path / f"resume-{r}.json").read_text()) for r in range(2)] == after
    assert after[0] != after[1]
    spawn(worker, 1, ["resume-one", root, str(tmp_path)], 240)  # one rank now: it takes saved rank 0's
    assert json.loads((tmp_path / "resume-one-0.json").read_text()) == after[0]


def test_dcp_per_rank_refuses_another_rank_count_without_a_hook():
    pytest.importorskip("torch")
    from ckptio.dcp import PerRank

    with pytest.raises(ValueError, match="saved by 4 ranks, loaded by 1"):
        PerRank(Counter(), saved_world=4).state_dict()
