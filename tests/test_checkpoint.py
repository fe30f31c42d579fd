"""Checkpoints: round trip of the whole train state, keep-last-N, interrupted saves that must
never cost the last good checkpoint, and restores that fall back only past a damaged one."""

import errno
import glob
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.drafters.head import init_head
from specjax.drafters.vocab import identity_maps
from specjax.models import Decoder, ModelConfig
from specjax.errors import UserError
from specjax.rl.checkpoint import (CheckpointExists, CheckpointMismatch, Checkpointer,
                                   DamagedCheckpoint, NonFiniteState, run_identity)
from specjax.rl.config import DraftConfig, RLConfig
from specjax.rl.train_step import Trainer
from specjax.sharding import MeshConfig, make_mesh

MODEL = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=8, mlp_hidden=32)
CFG = RLConfig(model=MODEL, draft=DraftConfig(kind="eagle3", online=True))


def _state(seed: int, mesh=None):
  pg, pp = nnx.split(Decoder(MODEL, rngs=nnx.Rngs(seed)))
  hg, hp = nnx.split(init_head(MODEL, seed=seed + 1))
  trainer = Trainer(CFG, pg, hg, mesh=mesh)
  state = trainer.init_state(pp, hp, identity_maps(MODEL.vocab_size))
  # make the optimizer moments non-trivial so that a mix-up would show
  return state.replace(opt_state=jax.tree.map(lambda x: x + 0.5 if x.dtype == jnp.float32 else x,
                                              state.opt_state), step=jnp.int32(seed))


def _assert_same(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_whole_train_state_rng_and_data_position_round_trip(tmp_path):
  ckpt = Checkpointer(str(tmp_path), keep=2)
  state = _state(3)
  key = jax.random.PRNGKey(42)
  assert ckpt.save(5, state, rng=key, data_position=40, extra={"note": "x"})
  restored, meta = ckpt.restore(_state(0))
  _assert_same(restored, state)
  assert meta["step"] == 5 and meta["data_position"] == 40 and meta["extra"] == {"note": "x"}
  np.testing.assert_array_equal(meta["rng"], np.asarray(key))
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  ckpt.close()


def test_only_the_last_n_checkpoints_are_kept(tmp_path):
  ckpt = Checkpointer(str(tmp_path), keep=2)
  state = _state(1)
  for step in (1, 2, 3):
    ckpt.save(step, state, rng=jax.random.PRNGKey(step), data_position=step)
  assert ckpt.steps() == [2, 3]
  assert sorted(n for n in os.listdir(tmp_path) if n.isdigit()) == ["2", "3"]
  ckpt.close()


def test_an_interrupted_save_never_costs_the_last_good_checkpoint(tmp_path):
  ckpt = Checkpointer(str(tmp_path), keep=3)
  good = _state(2)
  ckpt.save(2, good, rng=jax.random.PRNGKey(2), data_position=16)
  ckpt.close()
  # a crash during the save of step 4: orbax's temporary dir is left behind ...
  os.makedirs(tmp_path / "4.orbax-checkpoint-tmp-1700000000" / "state")
  # ... and a crash while something copied step 6 into place: a step dir without its metadata
  shutil.copytree(tmp_path / "2" / "state", tmp_path / "6" / "state")
  with pytest.warns(UserWarning, match="incomplete"):
    ckpt = Checkpointer(str(tmp_path), keep=3)
  assert ckpt.latest_step() == 2
  restored, meta = ckpt.restore(_state(0))
  _assert_same(restored, good)
  assert meta["step"] == 2
  # the run goes on and can write those steps again
  assert ckpt.save(4, _state(4), rng=jax.random.PRNGKey(4), data_position=32)
  assert ckpt.save(6, _state(6), rng=jax.random.PRNGKey(6), data_position=48)
  assert ckpt.latest_step() == 6
  ckpt.close()


# tensorstore reports the failed read once more from a closed event loop; harmless
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
  ckpt = Checkpointer(str(tmp_path), keep=3)
  older, newer = _state(1), _state(2)
  ckpt.save(1, older, rng=jax.random.PRNGKey(1), data_position=8)
  ckpt.save(2, newer, rng=jax.random.PRNGKey(2), data_position=16)
  state_dir = tmp_path / "2" / "state"
  for root, _, files in os.walk(state_dir):  # lose the array data, keep the markers
    for f in files:
      if "metadata" not in f.lower():
        os.remove(os.path.join(root, f))
  with pytest.warns(UserWarning, match="does not restore"):
    restored, meta = ckpt.restore(_state(0))
  assert meta["step"] == 1
  _assert_same(restored, older)
  # the damaged step was moved aside: the resumed run saves that step again
  assert ckpt.save(2, newer, rng=jax.random.PRNGKey(2), data_position=16)
  ckpt.close()


def _two_steps(directory):
  ckpt = Checkpointer(str(directory), keep=3)
  for step in (1, 2):
    ckpt.save(step, {"w": jnp.full((64,), float(step))}, rng=jax.random.PRNGKey(step),
              data_position=8 * step)
  return ckpt


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def _flip_bytes(path):
  data = bytearray(open(path, "rb").read())
  for i in range(len(data) // 3, len(data)):
    data[i] ^= 0x5A
  open(path, "wb").write(bytes(data))


# (what is damaged, the damage, the reason the warning gives)
DAMAGE = [("meta/metadata", _truncate, r"meta/metadata does not parse"),
          ("meta/metadata", os.remove, r"meta/metadata is missing"),
          ("state/manifest.ocdbt", _flip_bytes, r"state/manifest.ocdbt does not decode"),
          ("state/d/*", os.remove, r"state/d/\w+ is missing"),
          ("state/d/*", _truncate, r"state/d/\w+ is shorter than its manifest says"),
          ("state/d/*", _flip_bytes, r"state/d/\w+ does not decode")]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("pattern,damage,reason", DAMAGE,
                         ids=[f"{p}-{d.__name__}" for p, d, _ in DAMAGE])
def test_a_damaged_file_of_the_newest_checkpoint_is_named_and_set_aside(tmp_path, pattern,
                                                                       damage, reason):
  ckpt = _two_steps(tmp_path)
  for path in glob.glob(str(tmp_path / "2" / pattern)):
    damage(path)
  with pytest.warns(UserWarning, match=rf"checkpoint 2 in {re.escape(str(tmp_path))} does not "
                                       rf"restore: it is damaged \({reason}.*\); moved to "
                                       rf".*damaged-2-\d+, resuming from checkpoint 1$"):
    _, meta = ckpt.restore({"w": jnp.zeros((64,))})
  assert meta["step"] == 1
  assert [n for n in os.listdir(tmp_path) if n.isdigit()] == ["1"]
  ckpt.close()


@pytest.mark.parametrize("error", [
    lambda d: OSError(errno.EIO, os.strerror(errno.EIO)),
    lambda d: RuntimeError("Sharding of the restored array does not match the device mesh"),
    lambda d: ValueError(f'UNKNOWN: Error reading local file "{d}/2/state/manifest.ocdbt": '
                         f'[OS error 5: Input/output error]'),
], ids=["eio", "sharding", "tensorstore-io"])
def test_a_restore_error_that_proves_no_damage_stops_the_restore_and_moves_nothing(tmp_path,
                                                                                  monkeypatch,
                                                                                  error):
  ckpt = _two_steps(tmp_path)
  real, failures = ckpt.manager.restore, []

  def flaky(step, *a, **kw):  # fails once, on the newest step
    if step == 2 and not failures:
      failures.append(error(tmp_path))
      raise failures[0]
    return real(step, *a, **kw)

  monkeypatch.setattr(ckpt.manager, "restore", flaky)
  with pytest.raises(Exception) as err:
    ckpt.restore({"w": jnp.zeros((64,))})
  assert err.value is failures[0]
  assert any("no checkpoint moved" in note for note in err.value.__notes__)
  assert sorted(os.listdir(tmp_path)) == ["1", "2"]
  # the error was transient: the next restore resumes from the newest step, as it should
  restored, meta = ckpt.restore({"w": jnp.zeros((64,))})
  assert meta["step"] == 2 and float(restored["w"][0]) == 2.0
  ckpt.close()


def test_when_every_checkpoint_is_damaged_restore_stops_rather_than_start_over(tmp_path):
  ckpt = _two_steps(tmp_path)
  for step in (1, 2):
    _truncate(tmp_path / str(step) / "meta" / "metadata")
  with pytest.raises(UserError, match=rf"every checkpoint in {re.escape(str(tmp_path))} is "
                                      rf"damaged \(2: meta/metadata does not parse.*; 1: "
                                      rf"meta/metadata does not parse.*\); nothing was moved"):
    ckpt.restore({"w": jnp.zeros((64,))})
  assert sorted(os.listdir(tmp_path)) == ["1", "2"]
  with pytest.raises(DamagedCheckpoint, match="checkpoint 1 .* is damaged"):
    ckpt.restore({"w": jnp.zeros((64,))}, step=1)
  ckpt.close()


def test_restoring_into_a_different_train_state_names_the_mismatch(tmp_path):
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(1, _state(1), rng=jax.random.PRNGKey(1), data_position=8)
  pg, pp = nnx.split(Decoder(MODEL, rngs=nnx.Rngs(0)))
  plain = Trainer(RLConfig(model=MODEL), pg).init_state(pp)  # no draft head
  with pytest.raises(ValueError, match="does not match the current train state"):
    ckpt.restore(plain)
  ckpt.close()


def test_restore_places_arrays_with_the_template_shardings(tmp_path):
  ckpt = Checkpointer(str(tmp_path))
  state = _state(1)
  ckpt.save(1, state, rng=jax.random.PRNGKey(1), data_position=8)
  mesh = make_mesh(MeshConfig(2, 2, 2))
  template = _state(0, mesh=mesh)
  restored, _ = ckpt.restore(template)
  _assert_same(restored, state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(template)):
    assert got.sharding == want.sharding
  ckpt.close()


def test_a_save_never_skips_an_existing_step_nor_writes_a_non_finite_state(tmp_path):
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(1, _state(1), rng=jax.random.PRNGKey(1), data_position=8)
  with pytest.raises(CheckpointExists, match=f"checkpoint 1 already exists in {tmp_path}"):
    ckpt.save(1, _state(2), rng=jax.random.PRNGKey(1), data_position=8)
  bad = _state(2)
  bad = bad.replace(params=jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan)
                                        if x.dtype == jnp.float32 else x, bad.params))
  with pytest.raises(NonFiniteState, match="refusing to checkpoint step 2.*non-finite"):
    ckpt.save(2, bad, rng=jax.random.PRNGKey(2), data_position=16)
  assert ckpt.steps() == [1]
  restored, _ = ckpt.restore(_state(0))
  _assert_same(restored, _state(1))
  ckpt.close()


def test_a_checkpoint_carries_its_run_identity_and_another_run_is_refused(tmp_path):
  ar = run_identity(CFG.replace(draft=DraftConfig(kind="none")))
  spec = run_identity(CFG)
  assert ar["digest"] != spec["digest"]
  # where it is saved, logged or validated, and how long it runs, do not change a trajectory
  assert run_identity(CFG.replace(steps=7, log_dir="x", progress=False))["digest"] == \
      spec["digest"]
  ckpt = Checkpointer(str(tmp_path), identity=spec)
  ckpt.save(1, _state(1), rng=jax.random.PRNGKey(1), data_position=8)
  ckpt.close()
  other = Checkpointer(str(tmp_path), identity=ar)
  with pytest.raises(CheckpointMismatch, match=r"belongs to another run .*draft.kind: "
                                                r"'eagle3' -> 'none'"):
    other.restore(_state(0))
  other.close()
  same = Checkpointer(str(tmp_path), identity=spec)
  assert same.restore(_state(0))[1]["identity"]["digest"] == spec["digest"]
  same.close()
