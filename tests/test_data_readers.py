"""Readers round-trip files written here and reject malformed ones with a one-line error."""

import gzip
import json
import os
import struct

import numpy as np
import pytest

from fedjax_opt import data

HEART_SCALE = "/usr/share/doc/liblinear-tools/examples/heart_scale"


def _one_line_error(call, path, fragment):
  with pytest.raises(ValueError) as err:
    call()
  message = str(err.value)
  assert message.startswith(os.fspath(path)), message
  assert "\n" not in message
  assert fragment in message, message
  return message


# ----------------------------------------------------------------------------
# LEAF JSON.
# ----------------------------------------------------------------------------


def _leaf(users, make_x, make_y, sizes):
  return {"users": users, "num_samples": sizes,
          "user_data": {u: {"x": make_x(n), "y": make_y(n)} for u, n in zip(users, sizes)}}


def _write_json(path, obj):
  path.write_text(json.dumps(obj))
  return path


def test_leaf_femnist_layout_round_trips(tmp_path):
  rng = np.random.default_rng(0)
  xs = {u: rng.random((n, 784)).round(4) for u, n in (("f0001_12", 3), ("f0002_07", 5))}
  ys = {u: rng.integers(0, 62, len(x)) for u, x in xs.items()}
  obj = {"users": list(xs), "num_samples": [len(x) for x in xs.values()],
         "user_data": {u: {"x": xs[u].tolist(), "y": ys[u].tolist()} for u in xs}}
  read = data.read_leaf_json(_write_json(tmp_path / "all_data_0.json", obj))
  assert read.client_names == ("f0001_12", "f0002_07")
  for u, client in zip(read.client_names, read.clients):
    np.testing.assert_allclose(client["x"], xs[u], rtol=1e-6)
    np.testing.assert_array_equal(client["y"], ys[u])
    assert client["x"].dtype == np.float32 and client["y"].dtype == np.int32


def test_leaf_shakespeare_strings_are_encoded_with_leaf_letters(tmp_path):
  letters = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
  text = "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer the slings"
  xs = [text[i:i + 80] for i in range(5)]
  ys = [text[i + 80] for i in range(5)]
  obj = {"users": ["HAMLET"], "num_samples": [5], "user_data": {"HAMLET": {"x": xs, "y": ys}}}
  client = data.read_leaf_json(_write_json(tmp_path / "s.json", obj)).clients[0]
  np.testing.assert_array_equal(client["x"], [[letters.index(c) for c in s] for s in xs])
  np.testing.assert_array_equal(client["y"], [letters.index(c) for c in ys])


def test_leaf_sent140_layout_needs_a_transform(tmp_path):
  records = [["1467810369", "Mon Apr 06", "NO_QUERY", "user", "good day"],
             ["1467810672", "Mon Apr 06", "NO_QUERY", "user", "bad day indeed"]]
  obj = {"users": ["user"], "num_samples": [2], "user_data": {"user": {"x": records, "y": [1, 0]}}}
  path = _write_json(tmp_path / "sent140.json", obj)
  _one_line_error(lambda: data.read_leaf_json(path), path, "transform=")
  lengths = lambda raw: {"x": [[len(r[4].split())] for r in raw["x"]], "y": raw["y"]}  # noqa: E731
  client = data.read_leaf_json(path, transform=lengths).clients[0]
  np.testing.assert_array_equal(client["x"], [[2], [3]])
  np.testing.assert_array_equal(client["y"], [1, 0])


def test_load_leaf_matches_test_users_by_name(tmp_path):
  train = _leaf(["a", "b"], lambda n: np.ones((n, 2)).tolist(), lambda n: [1] * n, [3, 4])
  test = _leaf(["b"], lambda n: np.zeros((n, 2)).tolist(), lambda n: [0] * n, [2])
  (tmp_path / "train").mkdir()
  (tmp_path / "test").mkdir()
  _write_json(tmp_path / "train" / "part0.json", train)
  _write_json(tmp_path / "test" / "part0.json", test)
  ds = data.load_leaf(tmp_path / "train", tmp_path / "test", num_classes=2)
  assert ds.client_names == ("a", "b")
  np.testing.assert_array_equal(ds.train_count, [3, 4])
  np.testing.assert_array_equal(ds.test_count, [0, 2])


@pytest.mark.parametrize("obj, fragment", [
    ({"users": ["a"], "num_samples": [1]}, "not LEAF JSON"),
    ({"users": ["a"], "num_samples": [1], "user_data": {}}, "missing from 'user_data'"),
    ({"users": ["a"], "num_samples": [3], "user_data": {"a": {"x": [[1.0]], "y": [0]}}}, "num_samples says"),
    ({"users": ["a"], "user_data": {"a": {"x": [[1.0], [2.0]], "y": [0]}}}, "2 x but 1 y"),
    ({"users": ["a"], "user_data": {"a": {"x": [[1.0, 2.0], [3.0]], "y": [0, 1]}}}, "ragged"),
    ({"users": ["a"], "user_data": {"a": {"x": [[1.0], [2.0]], "y": ["cat", "dog"]}}}, "non-numeric labels"),
    ({"users": ["a"], "user_data": {"a": {"pixels": [[1.0]], "y": [0]}}}, "must have keys 'x' and 'y'"),
    ({"users": ["a", "b"], "user_data": {"a": {"x": [[1.0]], "y": [0]}, "b": {"x": [[1.0, 2.0]], "y": [0]}}},
     "example shape"),
])
def test_malformed_leaf_files_are_rejected(tmp_path, obj, fragment):
  path = _write_json(tmp_path / "bad.json", obj)
  _one_line_error(lambda: data.read_leaf_json(path), path, fragment)


def test_invalid_json_is_rejected(tmp_path):
  path = tmp_path / "broken.json"
  path.write_text('{"users": [')
  _one_line_error(lambda: data.read_leaf_json(path), path, "not valid JSON")


# ----------------------------------------------------------------------------
# LibSVM / svmlight.
# ----------------------------------------------------------------------------


def test_svmlight_matches_scikit_learn_on_a_written_file(tmp_path):
  from sklearn.datasets import dump_svmlight_file, load_svmlight_file
  rng = np.random.default_rng(0)
  x = rng.random((30, 7)) * (rng.random((30, 7)) < 0.4)
  y = rng.choice([-1.0, 1.0], 30)
  path = tmp_path / "toy.svm"
  dump_svmlight_file(x, y, str(path), zero_based=False, comment="written by the test")
  ours = data.read_svmlight(path, num_features=7)
  ref_x, ref_y = load_svmlight_file(str(path), n_features=7, zero_based=False)
  np.testing.assert_allclose(ours["x"], ref_x.toarray(), rtol=1e-6)
  np.testing.assert_array_equal(ours["y"], (ref_y > 0).astype(int))  # -1, +1 -> 0, 1
  np.testing.assert_array_equal(data.read_svmlight(path, labels="raw")["y"], ref_y)


def test_svmlight_reads_qid_and_zero_based_indices(tmp_path):
  path = tmp_path / "rank.txt"
  path.write_text("3 qid:1 0:0.5 2:1.5 # comment\n1 qid:1 1:2\n\n2 qid:7 2:-1\n")
  out = data.read_svmlight(path)
  np.testing.assert_array_equal(out["x"], [[0.5, 0, 1.5], [0, 2, 0], [0, 0, -1]])
  np.testing.assert_array_equal(out["y"], [2, 0, 1])
  np.testing.assert_array_equal(out["qid"], [1, 1, 7])


@pytest.mark.skipif(not os.path.exists(HEART_SCALE), reason=f"{HEART_SCALE} is absent: it ships with Debian's "
                    "liblinear-tools package (apt-get install liblinear-tools)")
def test_svmlight_reads_debians_heart_scale_like_scikit_learn():
  from sklearn.datasets import load_svmlight_file
  ours = data.read_svmlight(HEART_SCALE)
  ref_x, ref_y = load_svmlight_file(HEART_SCALE)
  assert ours["x"].shape == (270, 13)
  np.testing.assert_allclose(ours["x"], ref_x.toarray(), rtol=1e-6)
  np.testing.assert_array_equal(ours["y"], (ref_y > 0).astype(int))


@pytest.mark.parametrize("text, fragment", [
    ("+1 1:0.5\nyes 1:0.2\n", "line 2: label 'yes' is not a number"),
    ("+1 1:0.5 2\n", "line 1: '2' is not index:value"),
    ("+1 a:0.5\n", "integer index"),
    ("+1 qid:1 1:0.5\n-1 1:0.5\n", "some lines have qid"),
    ("# only a comment\n", "holds no examples"),
])
def test_malformed_svmlight_files_are_rejected(tmp_path, text, fragment):
  path = tmp_path / "bad.svm"
  path.write_text(text)
  _one_line_error(lambda: data.read_svmlight(path), path, fragment)


# ----------------------------------------------------------------------------
# IDX.
# ----------------------------------------------------------------------------


def _write_idx(path, array, type_code, big_endian_dtype, compress=False):
  header = struct.pack(">BBBB", 0, 0, type_code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
  payload = header + array.astype(big_endian_dtype).tobytes()
  opener = gzip.open if compress else open
  with opener(path, "wb") as f:
    f.write(payload)
  return path


@pytest.mark.parametrize("compress", [False, True])
def test_idx_round_trips_images_and_labels(tmp_path, compress):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (6, 28, 28)).astype(np.uint8)
  labels = rng.integers(0, 10, 6).astype(np.uint8)
  suffix = ".gz" if compress else ""
  img = _write_idx(tmp_path / f"img-idx3-ubyte{suffix}", images, 0x08, ">u1", compress)
  lab = _write_idx(tmp_path / f"lab-idx1-ubyte{suffix}", labels, 0x08, ">u1", compress)
  np.testing.assert_array_equal(data.read_idx(img), images)
  out = data.read_idx_images(img, lab)
  assert out["x"].shape == (6, 28, 28, 1) and out["x"].dtype == np.float32
  np.testing.assert_allclose(out["x"][..., 0], images / 255.0)
  np.testing.assert_array_equal(out["y"], labels)
  assert data.read_idx_images(img, lab, flatten=True)["x"].shape == (6, 784)


def test_idx_reads_big_endian_floats_and_ints(tmp_path):
  values = np.linspace(-2, 2, 12).reshape(3, 4).astype(np.float32)
  np.testing.assert_array_equal(data.read_idx(_write_idx(tmp_path / "f.idx", values, 0x0D, ">f4")), values)
  ints = np.arange(-5, 5, dtype=np.int32)
  np.testing.assert_array_equal(data.read_idx(_write_idx(tmp_path / "i.idx", ints, 0x0C, ">i4")), ints)


def test_malformed_idx_files_are_rejected(tmp_path):
  bad_magic = tmp_path / "magic.idx"
  bad_magic.write_bytes(b"\x01\x00\x08\x01" + b"\x00" * 8)
  _one_line_error(lambda: data.read_idx(bad_magic), bad_magic, "not an IDX file")
  truncated = _write_idx(tmp_path / "short.idx", np.zeros((4, 5), np.uint8), 0x08, ">u1")
  truncated.write_bytes(truncated.read_bytes()[:-3])
  _one_line_error(lambda: data.read_idx(truncated), truncated, "need 20")
  unknown = tmp_path / "type.idx"
  unknown.write_bytes(b"\x00\x00\x07\x01\x00\x00\x00\x01\x00")
  _one_line_error(lambda: data.read_idx(unknown), unknown, "unknown IDX data type")
  img = _write_idx(tmp_path / "img.idx", np.zeros((3, 2, 2), np.uint8), 0x08, ">u1")
  lab = _write_idx(tmp_path / "lab.idx", np.zeros(4, np.uint8), 0x08, ">u1")
  _one_line_error(lambda: data.read_idx_images(img, lab), lab, "4 labels for the 3 images")


# ----------------------------------------------------------------------------
# TFF / FedJAX HDF5.
# ----------------------------------------------------------------------------


def _write_tff(path, clients):
  import h5py
  with h5py.File(path, "w") as f:
    for cid, features in clients.items():
      for name, value in features.items():
        f.create_dataset(f"examples/{cid}/{name}", data=value)
  return path


def test_tff_hdf5_round_trips_emnist_layout(tmp_path):
  pytest.importorskip("h5py", reason="h5py (the `hdf5` extra, part of `dev`) is not installed")
  rng = np.random.default_rng(0)
  clients = {f"f{i:04d}_00": {"pixels": rng.random((n, 28, 28)).astype(np.float32),
                              "label": rng.integers(0, 62, n).astype(np.int32)} for i, n in enumerate((3, 5, 1))}
  path = _write_tff(tmp_path / "fed_emnist_train.h5", clients)
  read = data.read_tff_hdf5(path)
  assert read.client_names == tuple(clients)
  for cid, client in zip(read.client_names, read.clients):
    np.testing.assert_array_equal(client["x"], clients[cid]["pixels"])
    np.testing.assert_array_equal(client["y"], clients[cid]["label"])
  kept = data.read_tff_hdf5(path, rename={})
  assert sorted(kept.clients[0]) == ["label", "pixels"]
  test_path = _write_tff(tmp_path / "fed_emnist_test.h5", {"f0001_00": clients["f0001_00"]})
  ds = data.load_tff_hdf5(path, test_path)
  np.testing.assert_array_equal(ds.test_count, [0, 5, 0])


def test_malformed_tff_hdf5_files_are_rejected(tmp_path):
  h5py = pytest.importorskip("h5py", reason="h5py (the `hdf5` extra, part of `dev`) is not installed")
  no_group = tmp_path / "flat.h5"
  with h5py.File(no_group, "w") as f:
    f.create_dataset("pixels", data=np.zeros((2, 2)))
  _one_line_error(lambda: data.read_tff_hdf5(no_group), no_group, "top-level group 'examples'")
  ragged = _write_tff(tmp_path / "ragged.h5", {"a": {"pixels": np.zeros((3, 2)), "label": np.zeros(2)}})
  _one_line_error(lambda: data.read_tff_hdf5(ragged), ragged, "different numbers of examples")
  strings = _write_tff(tmp_path / "text.h5", {"a": {"snippets": np.array([b"to be", b"or not"])}})
  _one_line_error(lambda: data.read_tff_hdf5(strings), strings, "non-numeric")
  not_hdf5 = tmp_path / "plain.h5"
  not_hdf5.write_text("hello")
  _one_line_error(lambda: data.read_tff_hdf5(not_hdf5), not_hdf5, "not an HDF5 file")


# ----------------------------------------------------------------------------
# NumPy .npz.
# ----------------------------------------------------------------------------


def test_npz_round_trips_a_file_written_with_numpy(tmp_path):
  rng = np.random.default_rng(0)
  arrays = {"alice/x": rng.random((4, 3)), "alice/y": np.arange(4), "bob/x": rng.random((2, 3)), "bob/y": [5, 6]}
  path = tmp_path / "clients.npz"
  np.savez(path, **arrays)
  read = data.read_npz(path)
  assert read.client_names == ("alice", "bob")
  np.testing.assert_allclose(read.clients[0]["x"], arrays["alice/x"], rtol=1e-6)
  np.testing.assert_array_equal(read.clients[1]["y"], [5, 6])
  again = tmp_path / "again.npz"
  data.write_npz(again, read.clients, read.client_names)
  reread = data.read_npz(again)
  for a, b in zip(read.clients, reread.clients):
    np.testing.assert_array_equal(a["x"], b["x"])


def test_malformed_npz_files_are_rejected(tmp_path):
  flat = tmp_path / "flat.npz"
  np.savez(flat, x=np.zeros(3))
  _one_line_error(lambda: data.read_npz(flat), flat, "is not '<client>/<feature>'")
  ragged = tmp_path / "ragged.npz"
  np.savez(ragged, **{"a/x": np.zeros((3, 2)), "a/y": np.zeros(2)})
  _one_line_error(lambda: data.read_npz(ragged), ragged, "different numbers of examples")
  labels = tmp_path / "labels.npz"
  np.savez(labels, **{"a/x": np.zeros((2, 2)), "a/y": np.array(["cat", "dog"])})
  _one_line_error(lambda: data.read_npz(labels), labels, "non-numeric labels")
  missing = tmp_path / "missing.npz"
  np.savez(missing, **{"a/x": np.zeros((2, 2)), "a/y": np.zeros(2), "b/x": np.zeros((1, 2))})
  _one_line_error(lambda: data.read_npz(missing), missing, "client 'b' has features ['x']")
  pickled = tmp_path / "pickled.npz"
  np.savez(pickled, **{"a/x": np.array([[1], [1, 2]], dtype=object)})
  _one_line_error(lambda: data.read_npz(pickled), pickled, "a/x")


def test_missing_files_raise_file_not_found(tmp_path):
  for reader in (data.read_leaf_json, data.read_svmlight, data.read_idx, data.read_npz, data.read_tff_hdf5):
    with pytest.raises(FileNotFoundError, match="no such file"):
      reader(tmp_path / "absent.file")


# ----------------------------------------------------------------------------
# Non-finite values: every reader refuses them, naming the file and where.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("token", ["2:nan", "2:NaN", "2:inf", "2:-inf", "2:Infinity"])
def test_svmlight_refuses_nan_and_inf_naming_the_line(tmp_path, token):
  path = tmp_path / "bad.svm"
  path.write_text(f"+1 1:0.5 2:0.25\n# a comment line still counts\n-1 1:0.5 {token}\n")
  assert not np.isfinite(float(token.split(":")[1]))  # a number to Python's float(), which parses the values
  message = _one_line_error(lambda: data.read_svmlight(path), path, "")
  assert message == f"{path}: line 3: {token!r} is not a finite number (NaN and Inf are refused)."


def test_svmlight_refuses_values_beyond_float32_and_non_finite_labels(tmp_path):
  big = tmp_path / "big.svm"
  big.write_text("+1 1:0.5\n-1 1:1e39\n")  # finite in float64, inf in the float32 features
  with np.errstate(over="ignore"):
    assert np.isinf(np.float32(1e39))
  message = _one_line_error(lambda: data.read_svmlight(big), big, "")
  assert message == (f"{big}: line 2: '1:1e39' is beyond float32's range (±3.402823e+38), in which the features "
                     f"are stored.")
  edge = tmp_path / "edge.svm"
  edge.write_text(f"+1 1:{float(np.finfo(np.float32).max)!r}\n-1 1:-0.5\n")  # the largest float32 itself is fine
  assert data.read_svmlight(edge)["x"][0, 0] == np.finfo(np.float32).max
  label = tmp_path / "label.svm"
  label.write_text("+1 1:0.5\nnan 1:0.5\n")
  assert _one_line_error(lambda: data.read_svmlight(label), label, "") == (
      f"{label}: line 2: label 'nan' is not a finite number.")
  raw = tmp_path / "raw.svm"
  raw.write_text("1e39 1:0.5\n-1 1:0.5\n")
  assert data.read_svmlight(raw)["y"].tolist() == [1, 0]  # as an index, a large label is just the larger one
  assert _one_line_error(lambda: data.read_svmlight(raw, labels="raw"), raw, "") == (
      f"{raw}: line 1: label '1e39' is not a finite number in float32.")


def test_command_line_refuses_a_libsvm_file_with_nan_before_training(cli, tmp_path):
  """The file, not the algorithm: it was read and trained on ("finished", objective gap nan; with inf, "dane
  diverged at round 2")."""
  for value in ("nan", "inf"):
    path = tmp_path / f"{value}.svm"
    path.write_text("".join(f"{(-1) ** i:+d} 1:{i / 10} 2:{(i % 3) / 3}\n" for i in range(40))
                    .replace("2:0.3333333333333333\n", f"2:{value}\n", 1))
    out = tmp_path / f"run_{value}"
    result = cli("run", "--algorithms", "dane", "--dataset", f"libsvm:{path}", "--num-clients", "2",
                 "--clients-per-round", "2", "--rounds", "2", "--out", out, "--quiet")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{path}: line 2: '2:{value}' is not a finite number" in lines[0], result.stderr
    assert "diverged" not in result.stdout + result.stderr and not out.exists()


def test_leaf_json_refuses_nan_inf_and_float32_overflow_naming_file_client_and_example(tmp_path):
  folder = tmp_path / "train"
  folder.mkdir()
  _write_json(folder / "part0.json", _leaf(["a"], lambda n: [[0.0, 1.0]] * n, lambda n: [0] * n, [2]))
  for value, shown in ((float("nan"), "nan"), (float("-inf"), "-inf"), (1e39, "inf")):
    second = _leaf(["b", "c"], lambda n: [[0.0, 1.0]] * n, lambda n: [1] * n, [2, 3])
    second["user_data"]["c"]["x"][2] = [0.0, value]
    path = _write_json(folder / "part1.json", second)
    assert "NaN" in path.read_text() or "Infinity" in path.read_text() or value == 1e39  # what json writes
    message = _one_line_error(lambda: data.read_leaf_json(folder), path, "")  # the file inside the folder
    assert message == (f"{path}: client 'c' example 2: 'x' holds {shown} at feature index 1; clean the data, or read "
                       f"it with load_leaf(..., drop_nonfinite=True) to drop the examples that hold NaN or Inf.")
  # load_leaf still drops them when asked, and names the file otherwise.
  with pytest.warns(UserWarning, match=r"dropped 1 example\(s\)"):
    dropped = data.load_leaf(folder, num_classes=2, test_fraction=0, drop_nonfinite=True)
  np.testing.assert_array_equal(dropped.train_count, [2, 2, 2])
  with pytest.raises(ValueError, match=rf"^{path}: client 'c' example 2: 'x' holds inf at feature index 1; clean "
                                       r"the data, or pass drop_nonfinite=True"):
    data.load_leaf(folder, num_classes=2, test_fraction=0)


def test_tff_hdf5_refuses_nan_naming_file_client_and_example(tmp_path):
  # h5py comes with `.[dev]`, so CI runs this; only an install without the extra skips it, as the file's other
  # HDF5 tests do (the reader itself imports h5py only when called).
  pytest.importorskip("h5py", reason="h5py (the `hdf5` extra, part of `dev`) is not installed")
  pixels = np.zeros((4, 3, 3), np.float32)
  pixels[2, 1, 0] = np.nan
  clients = {"f0000_00": {"pixels": np.zeros((2, 3, 3), np.float32), "label": np.zeros(2, np.int32)},
             "f0001_00": {"pixels": pixels, "label": np.zeros(4, np.int32)}}
  path = _write_tff(tmp_path / "train.h5", clients)
  message = _one_line_error(lambda: data.read_tff_hdf5(path), path, "")
  assert message.startswith(f"{path}: client 'f0001_00' example 2: 'x' holds nan at feature index (1, 0); "), message
  assert data.read_tff_hdf5(path, client_ids=["f0000_00"]).client_names == ("f0000_00",)  # the clean client alone
  with pytest.raises(ValueError, match=rf"^{path}: client 'f0001_00' example 2"):
    data.load_tff_hdf5(path, test_fraction=0)
  doubles = _write_tff(tmp_path / "doubles.h5", {"a": {"pixels": np.full((2, 2), 1e39), "label": np.zeros(2)}})
  message = _one_line_error(lambda: data.read_tff_hdf5(doubles), doubles, "")
  assert message.startswith(f"{doubles}: client 'a' example 0: 'x' holds inf at feature index 0; "), message


def test_npz_refuses_inf_naming_file_client_and_example(tmp_path):
  x = np.ones((5, 3))
  x[3, 2] = -np.inf
  path = tmp_path / "clients.npz"
  np.savez(path, **{"alice/x": np.ones((2, 3)), "alice/y": [0, 1], "bob/x": x, "bob/y": np.arange(5)})
  message = _one_line_error(lambda: data.read_npz(path), path, "")
  assert message.startswith(f"{path}: client 'bob' example 3: 'x' holds -inf at feature index 2; "), message
  targets = tmp_path / "targets.npz"
  np.savez(targets, **{"a/x": np.ones((2, 1)), "a/y": [0.5, np.nan]})
  message = _one_line_error(lambda: data.read_npz(targets), targets, "")
  assert message.startswith(f"{targets}: client 'a' example 1: 'y' is nan; "), message


def test_idx_refuses_nan_and_float32_overflow_naming_file_and_example(tmp_path):
  values = np.zeros((3, 2, 2), np.float32)
  values[1, 0, 1] = np.nan
  path = _write_idx(tmp_path / "f.idx", values, 0x0D, ">f4")
  message = _one_line_error(lambda: data.read_idx(path), path, "")
  assert message.startswith(f"{path}: example 1 holds nan at feature index (0, 1); "), message
  labels = _write_idx(tmp_path / "lab.idx", np.zeros(3, np.uint8), 0x08, ">u1")
  _one_line_error(lambda: data.read_idx_images(path, labels), path, "example 1 holds nan")
  doubles = np.zeros((3, 2, 2))
  doubles[2, 1, 1] = 1e39  # finite in the file's float64, inf as float32
  big = _write_idx(tmp_path / "d.idx", doubles, 0x0E, ">f8")
  assert data.read_idx(big)[2, 1, 1] == 1e39
  message = _one_line_error(lambda: data.read_idx_images(big, labels), big, "")
  assert message.startswith(f"{big}: example 2 holds inf at feature index (1, 1); "), message
  vector = _write_idx(tmp_path / "v.idx", np.array([0.0, np.inf]), 0x0E, ">f8")
  assert _one_line_error(lambda: data.read_idx(vector), vector, "").startswith(f"{vector}: example 1 is inf; ")
