"""The KL reference moves as `learner.reference` says, every `reference_every` GRPO steps: a periodic copy
lands exactly at multiples of N and stays put between; an EMA update equals a·ref + (1−a)·policy worked
out from the tensors; a resumed run restores the reference and the step counter that times it. With
LoRA (a second, frozen adapter) and full fine-tune (a frozen model copy), at world size 1 on tiny-random."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.learner import Learner
from configs.loader import ConfigError, load_config
from tests.actors.test_learner import fixed_batch, make_cfg


def learner_with(mode: str, reference: str, every: int, a: float = 0.75) -> Learner:
    cfg = make_cfg(mode, lr=1e-2 if mode == "lora" else 1e-3, reference=reference, reference_every=every)
    cfg.learner.reference_ema = a
    cfg.algorithm.kl_coef = 0.05
    learner = Learner(cfg)
    kind = learner.setup()["reference"]
    assert kind == ("adapter" if mode == "lora" else "model")
    return learner


def pairs(learner: Learner) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, reference tensor, policy tensor), cloned: the reference adapter against the trained one
    (LoRA), or the reference model's parameters against the policy's (full)."""
    if learner.lora:
        params = dict(learner.model.named_parameters())
        names = [n for n in params if ".reference." in n]
        out = [(n, params[n], params[n.replace(".reference.", ".default.")]) for n in names]
    else:
        out = [
            (n, r, p)
            for (n, r), p in zip(learner.reference.named_parameters(), learner.model.parameters(), strict=True)
        ]
    assert out
    return [(n, r.detach().clone(), p.detach().clone()) for n, r, p in out]


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_periodic_copies_at_multiples_of_n_and_stays_put_between(mode: str) -> None:
    learner = learner_with(mode, "periodic", every=2)
    batch = fixed_batch()
    start = pairs(learner)
    expected_ref = [r for _, r, _ in start]
    for step in range(1, 5):
        learner.train_step(batch)
        now = pairs(learner)
        if step % 2 == 0:  # a copy of the policy as it is after this step (in the reference's dtype)
            expected_ref = [p.to(r.dtype) for _, r, p in now]
        for (name, ref, _), want in zip(now, expected_ref, strict=True):
            assert torch.equal(ref, want), (step, name)
        # the policy has moved away from a reference copied before this step
        assert step % 2 == 0 or any(not torch.equal(r, p.to(r.dtype)) for _, r, p in now), step


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_ema_blends_every_n_steps_as_computed_by_hand(mode: str) -> None:
    a = 0.75
    learner = learner_with(mode, "ema", every=2, a=a)
    batch = fixed_batch()
    ref = [r for _, r, _ in pairs(learner)]
    for step in range(1, 4):
        learner.train_step(batch)
        now = pairs(learner)
        if step % 2 == 0:
            ref = [a * r + (1 - a) * p for r, (_, _, p) in zip(ref, now, strict=True)]
            for (name, got, _), want in zip(now, ref, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"step {step}: {name}")
            assert any(not torch.equal(got, p) for _, got, p in now), "an EMA with a < 1 is not a copy"
            ref = [got for _, got, _ in now]  # lerp rounds apart from the formula: go on from what it holds
        else:  # between updates the reference is exactly what it was
            for (name, got, _), want in zip(now, ref, strict=True):
                assert torch.equal(got, want), (step, name)
    assert learner.iteration == 3


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_resume_restores_the_reference_and_its_step_counter(mode: str, tmp_path: Path) -> None:
    """Saved after step 3 (the reference last moved at step 2), the resumed learner updates it at step 4,
    as the unbroken one does: to the same tensors, and the KL it trains against is the same."""
    batch = fixed_batch()
    first = learner_with(mode, "ema", every=2, a=0.5)
    for _ in range(3):
        first.train_step(batch)
    first.save_checkpoint(str(tmp_path / "ckpt"), {})
    expected_metrics = first.train_step(batch)
    expected = pairs(first)
    del first

    second = learner_with(mode, "ema", every=2, a=0.5)
    fresh = pairs(second)
    second.load_checkpoint(str(tmp_path / "ckpt"))
    assert second.iteration == 3
    loaded = pairs(second)
    assert any(not torch.equal(r0, r1) for (_, r0, _), (_, r1, _) in zip(fresh, loaded, strict=True))
    metrics = second.train_step(batch)
    assert metrics["kl"] == expected_metrics["kl"]
    for (name, ref, pol), (_, want_ref, want_pol) in zip(pairs(second), expected, strict=True):
        assert torch.equal(ref, want_ref), name
        assert torch.equal(pol, want_pol), name


@pytest.mark.parametrize("reference", ["periodic", "ema"])
def test_a_moving_reference_needs_a_period(reference: str) -> None:
    assert load_config(None, [f"learner.reference={reference}"]).learner.reference_every == 100  # the default
    with pytest.raises(ConfigError, match=rf"reference_every must be >= 1 with learner.reference '{reference}'"):
        load_config(None, [f"learner.reference={reference}", "learner.reference_every=0"])
    assert load_config(None, ["learner.reference_every=0"]).learner.reference == "fixed"  # unused there
