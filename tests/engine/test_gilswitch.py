"""The switch interval while a save's background work runs (ckptio.engine.gilswitch).

Properties: the setting is read from the engine config, else the environment, with bad values
named; the interval is shortened only while a save runs, never lengthened, put back when the last
overlapping save ends, and left alone where somebody else changed it meanwhile; a native save's
and a DCP save's storage calls run under it, and ``0`` leaves the process's interval untouched.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

import ckptio
from ckptio import SaveOptions
from ckptio.backends._wrapper_base import WrapperBackend
from ckptio.backends.memory import MemoryBackend
from ckptio.engine import gilswitch

ORIGINAL = 0.005


@pytest.fixture(autouse=True)
def _interval(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts from the interpreter's default interval and no setting in the environment."""
    monkeypatch.delenv(gilswitch.ENV, raising=False)
    before = sys.getswitchinterval()
    sys.setswitchinterval(ORIGINAL)
    yield
    sys.setswitchinterval(before)


class TestSetting:
    def test_default_without_config_or_environment(self) -> None:
        assert gilswitch.interval_for(None) == gilswitch.DEFAULT_S
        assert SaveOptions().gil_interval() == gilswitch.DEFAULT_S

    def test_environment_then_config(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(gilswitch.ENV, "0.001")
        assert SaveOptions().gil_interval() == 0.001
        assert SaveOptions(gil_switch_s=0.002).gil_interval() == 0.002  # the option wins

    def test_zero_leaves_the_interval(self, monkeypatch: pytest.MonkeyPatch) -> None:
        assert SaveOptions(gil_switch_s=0).gil_interval() is None
        monkeypatch.setenv(gilswitch.ENV, "0")
        assert gilswitch.interval_for(None) is None

    @pytest.mark.parametrize("bad", ["fast", "-1", "nan", "inf"])
    def test_a_bad_environment_value_is_named(self, monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
        monkeypatch.setenv(gilswitch.ENV, bad)
        with pytest.raises(ValueError, match=f"{gilswitch.ENV}={bad!r}"):
            gilswitch.interval_for(None)

    def test_a_bad_config_value_is_named(self) -> None:
        with pytest.raises(ValueError, match="SaveOptions.gil_switch_s=-0.5"):
            SaveOptions(gil_switch_s=-0.5)  # refused when made, before any save


class TestShortened:
    def test_shortens_and_puts_back(self) -> None:
        with gilswitch.shortened(0.0005):
            assert sys.getswitchinterval() == pytest.approx(0.0005)
        assert sys.getswitchinterval() == pytest.approx(ORIGINAL)

    def test_none_leaves_it(self) -> None:
        with gilswitch.shortened(None):
            assert sys.getswitchinterval() == pytest.approx(ORIGINAL)

    def test_never_lengthens(self) -> None:
        sys.setswitchinterval(0.0001)
        with gilswitch.shortened(0.0005):
            assert sys.getswitchinterval() == pytest.approx(0.0001)
        assert sys.getswitchinterval() == pytest.approx(0.0001)

    def test_put_back_after_a_failure(self) -> None:
        with pytest.raises(RuntimeError), gilswitch.shortened(0.0005):
            raise RuntimeError("the save failed")
        assert sys.getswitchinterval() == pytest.approx(ORIGINAL)

    def test_overlapping_saves_put_back_once_the_last_ends(self) -> None:
        first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
        seen: dict[str, float] = {}

        def first() -> None:
            with gilswitch.shortened(0.001):
                first_in.set()
                second_in.wait(10)
            first_out.set()

        t = threading.Thread(target=first)
        t.start()
        first_in.wait(10)
        with gilswitch.shortened(0.0005):  # shorter: it stands while both run
            second_in.set()
            first_out.wait(10)
            seen["after first"] = sys.getswitchinterval()
        t.join()
        assert seen["after first"] == pytest.approx(0.0005)  # the first's end does not put it back
        assert sys.getswitchinterval() == pytest.approx(ORIGINAL)

    def test_a_value_somebody_else_set_meanwhile_stands(self) -> None:
        with gilswitch.shortened(0.0005):
            sys.setswitchinterval(0.002)  # the trainer's own choice, made while a save runs
        assert sys.getswitchinterval() == pytest.approx(0.002)


    def test_a_child_forked_during_a_save_starts_with_the_value_found(self) -> None:
        read, write = os.pipe()
        with gilswitch.shortened(0.0005):
            pid = os.fork()
            if pid == 0:  # the child: no save of its own runs
                os.write(write, repr(sys.getswitchinterval()).encode())
                os._exit(0)
            os.close(write)
            assert sys.getswitchinterval() == pytest.approx(0.0005)  # the parent's save still runs
        os.waitpid(pid, 0)
        with os.fdopen(read) as f:
            assert float(f.read()) == pytest.approx(ORIGINAL)
        assert sys.getswitchinterval() == pytest.approx(ORIGINAL)


class IntervalSpy(WrapperBackend):
    """Records the process's switch interval at every storage call that writes."""

    def __init__(self, url: str) -> None:
        MemoryBackend.forget(url)
        super().__init__(MemoryBackend(url))
        self.seen: list[float] = []

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        self.seen.append(sys.getswitchinterval())
        await self.inner.write(key, buffers)

    async def create_if_absent(self, key: str, data: bytes) -> None:
        self.seen.append(sys.getswitchinterval())
        await self.inner.create_if_absent(key, data)


def _state() -> dict[str, np.ndarray]:
    return {"w": np.arange(1 << 16, dtype=np.float32), "b": np.ones(7, np.int64)}


def test_a_save_commits_under_the_short_interval_and_puts_it_back() -> None:
    spy = IntervalSpy("memory://gilswitch-native")
    ckptio.save("memory://gilswitch-native", _state(), step=1, backend=spy,
                save_options=SaveOptions(gil_switch_s=0.0005)).result()
    assert spy.seen and spy.seen[-1] == pytest.approx(0.0005)  # the manifest: the commit's last write
    assert sys.getswitchinterval() == pytest.approx(ORIGINAL)
    got = ckptio.restore("memory://gilswitch-native", step=1, backend=spy.inner)
    np.testing.assert_array_equal(got["w"], _state()["w"])


def test_zero_leaves_a_save_alone() -> None:
    spy = IntervalSpy("memory://gilswitch-off")
    ckptio.save("memory://gilswitch-off", _state(), step=1, backend=spy,
                save_options=SaveOptions(gil_switch_s=0)).result()
    assert spy.seen and all(s == pytest.approx(ORIGINAL) for s in spy.seen)


def test_a_dcp_save_writes_and_commits_under_the_short_interval(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from ckptio.dcp import writer as dcp_writer

    seen: dict[str, float] = {}
    write, finish = dcp_writer.Writer._write, dcp_writer.Writer._finish

    def spy_write(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen["write"] = sys.getswitchinterval()
        return write(self, *args, **kwargs)

    def spy_finish(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen["finish"] = sys.getswitchinterval()
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(dcp_writer.Writer, "_write", spy_write)
    monkeypatch.setattr(dcp_writer.Writer, "_finish", spy_finish)
    monkeypatch.setenv(gilswitch.ENV, "0.0005")
    state = {"w": torch.arange(1024, dtype=torch.float32)}
    dcp.save(state, storage_writer=ckptio.dcp.Writer(str(tmp_path / "ck")))
    assert seen == {"write": pytest.approx(0.0005), "finish": pytest.approx(0.0005)}
    assert sys.getswitchinterval() == pytest.approx(ORIGINAL)


def test_a_bad_setting_refuses_the_save_on_the_callers_thread(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Read in the save's own thread it would kill that thread and leave result() waiting for good.
    monkeypatch.setenv(gilswitch.ENV, "fast")
    with pytest.raises(ValueError, match=f"{gilswitch.ENV}='fast'"):
        ckptio.save(str(tmp_path), _state(), step=1)
    monkeypatch.delenv(gilswitch.ENV)
    with pytest.raises(ckptio.CheckpointNotFoundError):
        ckptio.restore(str(tmp_path), step=1)
    ckptio.save(str(tmp_path), _state(), step=1).result()  # the step is free: nothing was announced
    np.testing.assert_array_equal(ckptio.restore(str(tmp_path), step=1)["w"], _state()["w"])


def test_a_bad_setting_refuses_a_dcp_writer_when_made(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    import ckptio.dcp

    monkeypatch.setenv(gilswitch.ENV, "-1")
    with pytest.raises(ValueError, match=f"{gilswitch.ENV}='-1'"):
        ckptio.dcp.Writer(str(tmp_path / "ck"))
