"""Federated data: embedded datasets, readers, partitioners, packing and in-jit round sampling.

    import fedjax_opt as fo
    ds = fo.data.load("mnist5k", partition="dirichlet", alpha=0.5, num_clients=100, seed=0)
    batches = fo.data.sample_round(key, ds, clients_per_round=10, local_steps=10, batch_size=20)

See docs/data.md.
"""

from fedjax_opt.data.dataset import (
    DEFAULT_MAX_PADDING_FACTOR,
    FederatedDataset,
    pack,
    pack_sequences,
    unpack,
)
from fedjax_opt.data.embedded import (
    CentralizedData,
    DatasetInfo,
    available,
    digits_arrays,
    fashion_mnist_arrays,
    federate,
    load,
    load_centralized,
    load_digits,
    load_fashion_mnist,
    load_mnist5k,
    mnist5k_arrays,
)
from fedjax_opt.data.planted import PLANTED_KINDS, plant_groups
from fedjax_opt.data.partition import (
    Partition,
    dirichlet_partition,
    iid_partition,
    label_partition,
    make_partition,
    natural_partition,
    power_law_partition,
    shard_partition,
)
from fedjax_opt.data.readers import (
    EXAMPLES,
    ClientData,
    example_path,
    load_leaf,
    load_tff_hdf5,
    read_idx,
    read_idx_images,
    read_leaf_json,
    read_npz,
    read_svmlight,
    read_tff_hdf5,
    write_npz,
)
from fedjax_opt.data.sampling import client_batches, sample_round, steps_for_epochs
from fedjax_opt.data.shakespeare import LEAF_VOCAB, load_shakespeare
from fedjax_opt.data.stragglers import StragglerDraw, draw_stragglers, drop_stragglers, stragglers
from fedjax_opt.data.synthetic import SyntheticData, SyntheticParams, generate_synthetic, load_synthetic

__all__ = [
    "DEFAULT_MAX_PADDING_FACTOR",
    "CentralizedData",
    "ClientData",
    "DatasetInfo",
    "EXAMPLES",
    "FederatedDataset",
    "LEAF_VOCAB",
    "PLANTED_KINDS",
    "Partition",
    "SyntheticData",
    "SyntheticParams",
    "StragglerDraw",
    "available",
    "client_batches",
    "digits_arrays",
    "dirichlet_partition",
    "draw_stragglers",
    "drop_stragglers",
    "example_path",
    "fashion_mnist_arrays",
    "federate",
    "generate_synthetic",
    "iid_partition",
    "label_partition",
    "load",
    "load_centralized",
    "load_digits",
    "load_fashion_mnist",
    "load_leaf",
    "load_mnist5k",
    "load_shakespeare",
    "load_synthetic",
    "load_tff_hdf5",
    "make_partition",
    "mnist5k_arrays",
    "natural_partition",
    "pack",
    "pack_sequences",
    "plant_groups",
    "power_law_partition",
    "read_idx",
    "read_idx_images",
    "read_leaf_json",
    "read_npz",
    "read_svmlight",
    "read_tff_hdf5",
    "sample_round",
    "shard_partition",
    "steps_for_epochs",
    "stragglers",
    "unpack",
    "write_npz",
]
