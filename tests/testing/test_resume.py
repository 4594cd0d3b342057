"""``ckptio.testing.check_resume`` on real loops (issue 34): torch + StatefulDataLoader, flax/optax + grain.

The builders and steps are module-level: the resumed part runs in a new (spawned) process, which imports them.
"""

from __future__ import annotations

import numpy as np
import pytest

from ckptio.testing import check_resume


def torch_build():
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    data = torch.randn(96, 3)
    g = torch.Generator()
    g.manual_seed(7)
    loader = StatefulDataLoader(data, batch_size=8, shuffle=True, num_workers=2, generator=g)
    return {"w": torch.zeros(3), "m": torch.zeros(3)}, loader


def torch_step(state, batch):
    # SGD with momentum on a least-squares loss, by hand: the state is plain tensors.
    w = state["w"].clone().requires_grad_(True)
    loss = ((batch @ w - batch.sum(1)) ** 2).mean()
    loss.backward()
    m = 0.9 * state["m"] + w.grad
    return {"w": (w - 0.05 * m).detach(), "m": m}, loss.detach()


class ForgetfulLoader:
    """A loader whose state says nothing: a resume starts its data over (the bug check_resume finds)."""

    def __init__(self) -> None:
        self.at = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.at += 1
        return np.full(2, self.at, np.float32)

    def get_state(self):
        return {}

    def set_state(self, state):
        pass


def forgetful_build():
    return {"acc": np.zeros(2, np.float32)}, ForgetfulLoader()


def forgetful_step(state, batch):
    return {"acc": state["acc"] + batch}, float(batch.sum())


def flax_build():
    import grain
    import jax
    import jax.numpy as jnp
    import optax

    params = {"w": jnp.zeros((4,)), "b": jnp.zeros(())}
    opt = optax.adam(0.1)
    ds = grain.MapDataset.range(64).shuffle(seed=3).map(lambda i: np.arange(4, dtype=np.float32) * i / 64).batch(4)
    return {"params": params, "opt": opt.init(params), "key": jax.random.key(1)}, iter(ds)


def flax_step(state, batch):
    import jax
    import jax.numpy as jnp
    import optax

    key, sub = jax.random.split(state["key"])
    noise = jax.random.normal(sub, batch.shape) * 0.01

    def loss_fn(p):
        return jnp.mean((jnp.asarray(batch + noise) @ p["w"] + p["b"] - 1.0) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = optax.adam(0.1).update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "key": key}, loss


def test_a_resume_that_loses_the_data_position_is_reported_at_its_first_step(tmp_path):
    report = check_resume(forgetful_build, forgetful_step, steps=6, save_at=3, new_process=False, workdir=tmp_path)
    assert not report.ok and report.step == 4 and report.what == "batch", report
    assert "4." in report.detail and "1." in report.detail  # the batch it should have seen, the one it saw


@pytest.mark.slow
def test_torch_stateful_dataloader_resumes_bit_exact_in_a_new_process(tmp_path):
    pytest.importorskip("torchdata")
    report = check_resume(torch_build, torch_step, steps=10, save_at=4, workdir=tmp_path)
    assert report.ok, report


@pytest.mark.slow
def test_flax_optax_grain_resumes_bit_exact(tmp_path):
    pytest.importorskip("grain")
    pytest.importorskip("optax")
    report = check_resume(flax_build, flax_step, steps=8, save_at=3, workdir=tmp_path)
    assert report.ok, report
